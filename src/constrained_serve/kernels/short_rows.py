"""Batched attention of the short rows of a step (torch path: on CPU where the native kernel,
native_decode.py, is not available or does not apply, and the reference it is tested against).

Decode rows and short chunks (grammar-forced tokens appended to a decoding request) are
grouped by context length; each group is attended with two batched GEMMs (QK^T, PV) and one
masked softmax over one gather of its pages, instead of one call per sequence. The GQA
group's query heads and the chunk's query slots together form each GEMM's rows, so a decode
row still fills G rows of its K/V operand. For these short query lengths the GEMMs are 2-3x
faster on CPU than torch's fused SDPA kernel, which tiles for long queries. The plan (index
tensors, masks) depends only on the batch layout, so it is built once per step and cached on
the metadata. Layout of q and the page pool: see attention.py and kv_layout.py.

Rows that share leading pages (a common system prompt, cached once by the radix tree) attend
to those keys in one GEMM per KV head with every row's queries stacked, over one gather of
the shared pages, and only gather their own pages past them (cascade attention, as in
FlashInfer and SGLang). Both parts' scores go through one softmax, so the result is exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .kv_layout import gather_heads
from .masking import additive_mask, masked_softmax, visible_keys

if TYPE_CHECKING:
    from .attention_metadata import AttentionMetadata

# Chunks up to this many tokens (decodes, grammar-forced tokens appended to a decoding request)
# are attended in batched calls with the decode rows; longer chunks get one call each.
SHORT_CHUNK = 16
# Leading pages shared by every row of a group are attended once for all rows from this many up.
MIN_SHARED_PAGES = 2


def _length_buckets(lens: list[int], min_rows: int = 16) -> list[list[int]]:
    """Group rows of similar length: each group is gathered padded to its own longest
    sequence, so short rows do not pay for the longest one (the gather is memory bound)."""
    order = sorted(range(len(lens)), key=lens.__getitem__)
    if len(order) < 2 * min_rows:
        return [order]
    buckets, cur = [], []
    for i in order:
        # Close a bucket once it holds min_rows rows and the next row is 25% longer.
        if len(cur) >= min_rows and lens[i] > 1.25 * lens[cur[0]]:
            buckets.append(cur)
            cur = []
        cur.append(i)
    if buckets and len(cur) < min_rows:
        buckets[-1].extend(cur)
    elif cur:
        buckets.append(cur)
    return buckets


@dataclass
class _ShortGroup:
    """One batched call over rows with short chunks, the same for every layer of a step."""

    shared_pages: torch.Tensor | None  # leading page ids common to all rows (keys visible to every query)
    pages: torch.Tensor  # [rows * npages] each row's own page ids past those, padded to the longest row
    padded_len: int  # keys gathered per row: (npages - shared pages) * page_size
    q_index: torch.Tensor  # [rows * nmax] token of each (row, query slot); padding repeats a row's last token
    nmax: int
    bias: (
        torch.Tensor
    )  # fp32 [rows, nmax * group, shared + padded_len keys]: 0 where a query slot sees the key, else -inf
    out_index: torch.Tensor  # tokens written back
    out_select: torch.Tensor | None  # which of the rows * nmax slots are real (None: all)
    buffers: dict = field(default_factory=dict, repr=False)  # gather destinations (kv_layout.py)


def short_groups(
    meta: AttentionMetadata, page_size: int, group: int, device: torch.device, min_len: int = 1
) -> list[_ShortGroup]:
    """Plan the batched calls once per step (cached on meta): the index tensors and masks only
    depend on the batch layout, not on the layer. Rows of min_len to SHORT_CHUNK query tokens
    (the shorter ones are the native kernel's, native_decode.py)."""
    key = ("short", page_size, group, min_len)
    if key in meta.plan_cache:
        return meta.plan_cache[key]
    qsl = meta.query_starts_host
    qlens_all = meta.query_lens_host
    # Decode rows and short chunks go to separate calls: a decode row padded to a chunk's
    # query length would multiply its (tiny) attention work for nothing.
    classes = [
        [b for b in range(meta.num_seqs) if max(lo, min_len) <= qlens_all[b] <= hi]
        for lo, hi in ((1, 1), (2, SHORT_CHUNK))
    ]
    groups = []
    for rows_of_class in classes:
        if not rows_of_class:
            continue
        lens = [meta.seq_lens_host[b] for b in rows_of_class]
        for bucket in _length_buckets(lens):
            rows = [rows_of_class[i] for i in bucket]
            qlens = [qlens_all[b] for b in rows]
            seq_lens = [meta.seq_lens_host[b] for b in rows]
            nmax = max(qlens)
            npages = -(-max(seq_lens) // page_size)
            table = meta.block_tables[torch.tensor(rows, device=device), :npages].long()
            nshared = _shared_pages(table, qlens, seq_lens, page_size)
            padded = (npages - nshared) * page_size
            # Table entries past a sequence's last page may be padding (-1): any valid id
            # will do, those keys are masked out.
            pages = table[:, nshared:].clamp_min(0).reshape(-1)
            shared = table[0, :nshared] if nshared else None
            slots = [min(j, n - 1) for n in qlens for j in range(nmax)]
            q_index = [qsl[b] + j for b, j in zip((b for b in rows for _ in range(nmax)), slots)]
            # Query j of a chunk of n sits at position L - n + j and sees keys at positions <= it.
            qpos = torch.tensor(
                [L - n + j for n, L in zip(qlens, seq_lens) for j in (min(j, n - 1) for j in range(nmax))],
                device=device,
            ).view(len(rows), nmax)
            bias = additive_mask(visible_keys(qpos, npages * page_size, group))
            real = [j < n for n in qlens for j in range(nmax)]
            select = None if all(real) else torch.tensor(real, device=device)
            out_index = [t for t, r in zip(q_index, real) if r]
            groups.append(
                _ShortGroup(
                    shared,
                    pages,
                    padded,
                    torch.tensor(q_index, device=device),
                    nmax,
                    bias,
                    torch.tensor(out_index, device=device),
                    select,
                )
            )
    meta.plan_cache[key] = groups
    return groups


def _shared_pages(table: torch.Tensor, qlens: list[int], seq_lens: list[int], page_size: int) -> int:
    """Leading pages that every row's table holds (same ids, so the same keys) and that every
    query slot of every row sees in full; 0 when fewer than MIN_SHARED_PAGES."""
    if table.shape[0] < 2:
        return 0
    same = (table == table[:1]).all(0).long().cumprod(0)
    n = min(int(same.sum()), min(L - q + 1 for q, L in zip(qlens, seq_lens)) // page_size)
    return n if n >= MIN_SHARED_PAGES else 0


def attend_short(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: _ShortGroup, scale: float, out: torch.Tensor
) -> None:
    """QK^T, masked softmax (fp32) and PV for a group of short rows, batched over (kv head, row)."""
    _, _, hkv, d = k_cache.shape
    hq = q.shape[1]
    group = hq // hkv
    rows, m = g.bias.shape[0], g.nmax * group
    k = gather_heads(k_cache, g.pages, g.buffers, "k").view(hkv * rows, g.padded_len, d)
    v = gather_heads(v_cache, g.pages, g.buffers, "v").view(hkv * rows, g.padded_len, d)
    # [rows, nmax, Hkv, G, D] -> [Hkv, rows, nmax * G, D]: one GEMM row per (query slot, group
    # head). One gather of q seen as [tokens * Hkv, G * D] rows puts them in that order.
    head_rows = g.buffers.get("head rows")
    if head_rows is None:
        head_rows = g.buffers["head rows"] = (
            g.q_index[None, :] * hkv + torch.arange(hkv, device=q.device)[:, None]
        ).reshape(-1)
    qd = q.reshape(-1, group * d).index_select(0, head_rows).view(hkv, rows * m, d)
    if g.shared_pages is None and q.dtype == torch.float32:  # (bf16/fp16 scores are upcast first)
        # The scale and the mask folded into the GEMM (C = bias + scale * QK^T), then the softmax.
        bias = g.buffers.get("bias heads")
        if bias is None:
            bias = g.buffers["bias heads"] = g.bias.expand(hkv, *g.bias.shape).reshape(hkv * rows, m, -1)
        probs = torch.baddbmm(bias, qd.view(hkv * rows, m, d), k.transpose(1, 2), alpha=scale).softmax(-1)
        probs = probs.view(hkv, rows, m, g.padded_len)
    else:
        scores = torch.bmm(qd.view(hkv * rows, m, d), k.transpose(1, 2)).view(hkv, rows, m, g.padded_len)
        if g.shared_pages is not None:
            ks = gather_heads(k_cache, g.shared_pages, g.buffers, "shared k")  # [Hkv, S, D]
            vs = gather_heads(v_cache, g.shared_pages, g.buffers, "shared v")
            # One [rows * m, D] x [D, S] GEMM per KV head: every row's queries against the shared keys.
            shared = torch.bmm(qd, ks.transpose(1, 2)).view(hkv, rows, m, -1)
            scores = torch.cat([shared, scores], -1)
        probs = masked_softmax(scores, scale, g.bias, v.dtype)
    own = probs[..., probs.shape[-1] - g.padded_len :].reshape(hkv * rows, m, g.padded_len)
    o = torch.bmm(own, v)  # [Hkv * rows, nmax * G, D]
    if g.shared_pages is not None:
        s = vs.shape[1]
        o.view(hkv, rows * m, d).add_(torch.bmm(probs[..., :s].reshape(hkv, rows * m, s), vs))
    if g.out_select is None and out.is_contiguous():
        # Every slot is real: the rows go back to their tokens through the same index.
        out.view(-1, group * d).index_copy_(0, head_rows, o.view(-1, group * d))
        return
    o = o.view(hkv, rows, g.nmax, group, d).permute(1, 2, 0, 3, 4).reshape(rows * g.nmax, hq, d)
    out[g.out_index] = o if g.out_select is None else o[g.out_select]
