"""Attention of the long chunks of a step (prefill chunks; torch path, used on CPU).

Each chunk longer than SHORT_CHUNK tokens is attended on its own: one gather of its pages,
then QK^T, a masked softmax and PV as two batched GEMMs over the KV heads, with the GQA
group's query heads folded into the query length ([Hkv, n*G, D]) so the group shares one
K/V operand. For the chunk sizes of a prefill step (up to a few hundred queries over a few
hundred keys) that is 2-3x faster on CPU than torch's fused SDPA kernel, which tiles for long
sequences. Chunks whose score matrix would be large go to SDPA (its flash kernel streams the
keys and never holds the whole matrix). Layout of q and the page pool: see attention.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .kv_layout import gather_heads
from .masking import additive_mask, masked_softmax, visible_keys
from .short_rows import SHORT_CHUNK

if TYPE_CHECKING:
    from .attention import AttentionMetadata

# Scores ([Hkv, n*G, L] floats) up to this many elements use the GEMM path: 4M fp32 = 16 MiB.
MAX_GEMM_SCORES = 1 << 22


@dataclass
class _LongChunk:
    """The per-step plan of one chunk, the same for every layer."""
    start: int  # its tokens are q[start:end]
    end: int
    seq_len: int  # keys: positions 0..seq_len-1
    pages: torch.Tensor  # page ids holding those keys
    # Additive fp32 [n*G, L] mask (0 visible, -inf hidden) for the GEMM path; None: SDPA with bool_mask.
    bias: torch.Tensor | None
    bool_mask: torch.Tensor | None
    buffers: dict = field(default_factory=dict, repr=False)  # gather destinations (kv_layout.py)


def long_chunks(meta: AttentionMetadata, page_size: int, hkv: int, group: int, device) -> list[_LongChunk]:
    """Plan every long chunk of the step once (cached on meta)."""
    key = ("long", page_size, hkv, group)
    if key in meta.plan_cache:
        return meta.plan_cache[key]
    plans, qsl = [], meta.query_starts_host
    for b in range(meta.num_decodes, meta.num_seqs):
        n = meta.query_lens_host[b]
        if n <= SHORT_CHUNK:
            continue
        L = meta.seq_lens_host[b]
        # Query j sits at position L-n+j; one row per (query, group head).
        visible = visible_keys(torch.arange(L - n, L, device=device), L, group)  # [n*G, L]
        pages = meta.block_tables[b, : -(-L // page_size)]
        if hkv * n * group * L <= MAX_GEMM_SCORES:
            plans.append(_LongChunk(qsl[b], qsl[b + 1], L, pages, additive_mask(visible), None))
        else:
            plans.append(_LongChunk(qsl[b], qsl[b + 1], L, pages, None, visible))
    meta.plan_cache[key] = plans
    return plans


def attend_long(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, c: _LongChunk,
                scale: float, out: torch.Tensor) -> None:
    _, _, hkv, d = k_cache.shape
    hq = q.shape[1]
    group, n, L = hq // hkv, c.end - c.start, c.seq_len
    k = gather_heads(k_cache, c.pages, c.buffers, "k")[:, :L]  # [Hkv, L, D]
    v = gather_heads(v_cache, c.pages, c.buffers, "v")[:, :L]
    qf = q[c.start:c.end].view(n, hkv, group, d).transpose(0, 1).reshape(hkv, n * group, d)
    if c.bias is not None and q.dtype == torch.float32:
        scores = torch.baddbmm(c.bias, qf, k.transpose(1, 2), alpha=scale)  # [Hkv, n*G, L]
        o = torch.bmm(scores.softmax(-1), v)
    elif c.bias is not None:
        o = torch.bmm(masked_softmax(torch.bmm(qf, k.transpose(1, 2)), scale, c.bias, v.dtype), v)
    else:
        # With a mask and no enable_gqa, torch's CPU SDPA takes its flash kernel.
        o = F.scaled_dot_product_attention(qf, k, v, attn_mask=c.bool_mask, scale=scale)
    out[c.start:c.end] = o.view(hkv, n, group, d).transpose(0, 1).reshape(n, hq, d)
