"""Shared builders for the kernel tests (and benchmarks/gpu_kernels.py): random paged batches,
a triton guard, and the reference distribution of the sampling filters."""

from __future__ import annotations

import math

import torch

from constrained_serve.batch import AttentionMetadata


def require_triton() -> None:
    """Fail (never skip): the Triton kernels are part of what CI must check."""
    from constrained_serve.kernels import attention

    if not attention.HAS_TRITON:
        import pytest

        pytest.fail(
            "triton is not installed: the Triton kernel tests need it "
            "(pip install triton; they run on CPU under TRITON_INTERPRET=1)"
        )


def make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    page_size: int,
    num_pages: int,
    gen: torch.Generator,
    pad_pages: int = 1,
    shared_pages: int = 0,
) -> AttentionMetadata:
    """Sequences get random distinct pages; the new tokens are the last query_len of each.
    shared_pages: every sequence's first pages are the same ones (a prefix cached once), and
    its new tokens come after them."""
    assert all(0 < n <= L for n, L in zip(query_lens, seq_lens))
    assert all(L - n >= shared_pages * page_size for n, L in zip(query_lens, seq_lens))
    decodes = 0
    while decodes < len(query_lens) and query_lens[decodes] == 1:
        decodes += 1
    need = [-(-L // page_size) for L in seq_lens]
    max_pages = max(need) + pad_pages
    assert shared_pages + sum(need) - shared_pages * len(need) <= num_pages
    perm = torch.randperm(num_pages, generator=gen)
    tables = torch.zeros(len(seq_lens), max_pages, dtype=torch.int32)
    slots, used = [], shared_pages
    for b, (n, L) in enumerate(zip(query_lens, seq_lens)):
        own = need[b] - shared_pages
        pages = torch.cat([perm[:shared_pages], perm[used : used + own]])
        used += own
        tables[b, : need[b]] = pages.to(torch.int32)
        for pos in range(L - n, L):
            slots.append(int(pages[pos // page_size]) * page_size + pos % page_size)
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    return AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_decodes=decodes,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_host=list(query_lens),
        seq_lens_host=list(seq_lens),
    )


def dense_causal_attention(
    q: torch.Tensor, k_full: list[torch.Tensor], v_full: list[torch.Tensor], meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Independent naive reference: per sequence, per head, explicit loops over positions."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    hq = q.shape[1]
    qsl = meta.query_start_loc.tolist()
    for b, L in enumerate(meta.seq_lens_host):
        k, v = k_full[b].double(), v_full[b].double()  # [L, Hkv, D]
        group = hq // k.shape[1]
        n = qsl[b + 1] - qsl[b]
        for j in range(n):
            pos = L - n + j
            for h in range(hq):
                qv = q[qsl[b] + j, h].double()
                s = (k[: pos + 1, h // group] @ qv) * scale
                p = torch.softmax(s, dim=0)
                out[qsl[b] + j, h] = p @ v[: pos + 1, h // group]
    return out


def expected_probs(
    logits: torch.Tensor, allowed: torch.Tensor | None, T: float, k: int, p: float, min_p: float
) -> torch.Tensor:
    """The filtered distribution by its definition, in float64, via a full sort."""
    x = logits.double().clone()
    if allowed is not None:
        x[~allowed] = -math.inf
    probs = torch.softmax(x / T, dim=-1)
    sp, order = probs.sort(descending=True, stable=True)
    keep = torch.ones_like(sp, dtype=torch.bool)
    if 0 < k < len(sp):
        keep[k:] = False
    if p < 1.0:
        keep &= (sp.cumsum(0) - sp) < p
    keep &= sp > 0
    if min_p > 0:
        keep &= sp >= min_p * sp[0]
    out = torch.zeros_like(probs)
    out[order[keep]] = sp[keep]
    return out / out.sum()
