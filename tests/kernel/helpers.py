"""Shared builders for the kernel tests (and benchmarks/gpu_kernels.py): random paged batches,
a paged KV case and the check of the torch attention against a dense reference, a triton
guard, and the reference distribution of the sampling filters."""

from __future__ import annotations

import math

import torch

from constrained_serve.kernels.attention_metadata import AttentionMetadata

# Chi-square critical values at significance 0.001, by degrees of freedom (scipy is not
# installed). Draws are seeded, so each test is deterministic; 0.001 keeps it from being
# brittle to a change of seeds.
CHI2_CRIT_001 = {
    1: 10.828,
    2: 13.816,
    3: 16.266,
    4: 18.467,
    5: 20.515,
    6: 22.458,
    7: 24.322,
    8: 26.124,
    9: 27.877,
    10: 29.588,
    11: 31.264,
    12: 32.909,
    13: 34.528,
    14: 36.123,
    15: 37.697,
}


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


def paged_case(
    query_lens,
    seq_lens,
    *,
    page_size=16,
    hkv=2,
    group=2,
    d=64,
    dtype=torch.float32,
    seed=0,
    head_major=False,
    shared_pages=0,
):
    """Writes each sequence's full K/V history into the pages via store_kv_torch.
    shared_pages: all sequences start with the same pages, holding the same keys (make_batch)."""
    from constrained_serve.kernels import attention as A
    from constrained_serve.kernels import kv_layout

    g = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-L // page_size) for L in seq_lens) + 3
    meta = make_batch(query_lens, seq_lens, page_size, num_pages, g, shared_pages=shared_pages)
    k_cache = kv_layout.allocate_pool(num_pages, page_size, hkv, d, dtype, torch.device("cpu"), head_major)
    v_cache = kv_layout.allocate_pool(num_pages, page_size, hkv, d, dtype, torch.device("cpu"), head_major)
    assert (kv_layout.heads_view(k_cache) is not None) == (head_major or hkv == 1)  # one head: both orders agree
    # Garbage in unused slots: attention must never read it.
    k_cache.copy_(torch.randn(k_cache.shape, generator=g))
    v_cache.copy_(torch.randn(v_cache.shape, generator=g))
    k_full, v_full = [], []
    for b, L in enumerate(seq_lens):
        k = torch.randn(L, hkv, d, generator=g).to(dtype)
        v = torch.randn(L, hkv, d, generator=g).to(dtype)
        if b and shared_pages:  # the shared prefix holds the same keys for everyone
            k[: shared_pages * page_size] = k_full[0][: shared_pages * page_size]
            v[: shared_pages * page_size] = v_full[0][: shared_pages * page_size]
        pages = meta.block_tables[b, : -(-L // page_size)].long()
        slots = (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)[:L]
        A.store_kv_torch(k, v, k_cache, v_cache, slots)
        k_full.append(k)
        v_full.append(v)
    q = torch.randn(sum(query_lens), hkv * group, d, generator=g).to(dtype)
    return q, k_cache, v_cache, meta, k_full, v_full


def assert_matches_dense(q, kc, vc, meta, kf, vf, scale=0.125, out=None):
    """The torch path (or ``out``, another kernel's result) against the float64 loop
    reference, at the tolerance of q's dtype."""
    from constrained_serve.kernels import attention as A

    tol = 1e-5 if q.dtype == torch.float32 else 3e-2
    torch.testing.assert_close(
        (A.paged_attention_torch(q, kc, vc, meta, scale) if out is None else out).double(),
        dense_causal_attention(q, kf, vf, meta, scale),
        atol=tol,
        rtol=tol,
    )


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
