"""Attention of the long chunks of a step (prefill chunks; torch path, used on CPU).

Each chunk longer than SHORT_CHUNK tokens is attended on its own: one gather of its pages,
then QK^T, a masked softmax and PV as two batched GEMMs over the KV heads, with the GQA
group's query heads folded into the query length ([Hkv, n*G, D]) so the group shares one
K/V operand. For the chunk sizes of a prefill step (up to a few hundred queries over a few
hundred keys) that is 2-3x faster on CPU than torch's fused SDPA kernel, which tiles for long
sequences. Chunks whose score matrix would be large go to SDPA (its flash kernel streams the
keys and never holds the whole matrix). Layout of q and the page pool: see attention.py.

On CPU (fp32 and bf16), chunks from a moderate size go one KV head at a time through
oneDNN's matmul instead (``per_head``): fp32 torch.bmm runs MKL, which takes a narrower code
path on AMD CPUs (models/cpu_linear.py says more), and both dtypes' batched GEMMs fall off a
cliff past ~128 queries. On the project's 2-core AMD EPYC, a 256-query chunk over 400 keys
takes 1.0 ms per layer that way against 4.4 ms batched (bf16: 1.3 against 4.6 ms), 512
queries over 1024 keys 5.6 ms against 23 ms (31 ms in SDPA), and in bf16 512 over 2048 keys
15 ms against 75 ms in SDPA. Chunks of up to ~100 queries are faster batched. One head at a
time also bounds the score memory by one head's matrix, so larger chunks stay on GEMMs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from . import onednn
from .kv_layout import gather_heads
from .masking import additive_mask, masked_softmax, visible_keys
from .short_rows import SHORT_CHUNK

if TYPE_CHECKING:
    from .attention_metadata import AttentionMetadata

# Scores ([Hkv, n*G, L] floats) up to this many elements use the batched GEMM path: 4M fp32 = 16 MiB.
MAX_GEMM_SCORES = 1 << 22
# The per-head path holds one head's [n*G, L] scores at a time: up to 8M fp32 = 32 MiB. It
# takes chunks from 64K scores per head: below, the batched GEMMs are as fast or faster
# (measured, fp32: 100 queries over 200 keys, 60K, the same; 128 over 228, 88K, 1.2x faster
# per head; 160 over 260, 3x. bf16: 1.4x slower per head at 60K, 2.4x faster at 88K).
MAX_HEAD_SCORES = 1 << 23
MIN_HEAD_SCORES = 1 << 16
# Rows ((query, group head) pairs) per block of the per-head path. Blocks keep the scores a
# few MiB and skip the keys past a block's last query: 512 queries over 1024 keys (fp32,
# 1536 rows) took 6.5-9 ms in blocks of 384-768 rows against 18-22 ms in one block (same
# run; this VM's absolute times drift a lot).
HEAD_BLOCK_ROWS = 512


def per_head_onednn(dtype: torch.dtype, device: torch.device) -> bool:
    """fp32 and bf16 on CPU: the per-head oneDNN path (CONSTRAINED_SERVE_CPU_LINEAR=torch
    turns it off, as it does the prepacked linears; fp16 has no fast oneDNN path without
    avx512_fp16)."""
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and onednn.enabled()
        and onednn.supports(dtype)
    )


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
    per_head: bool  # GEMM path one KV head at a time through oneDNN (CPU)
    buffers: dict = field(default_factory=dict, repr=False)  # gather destinations (kv_layout.py)


def long_chunks(
    meta: AttentionMetadata, page_size: int, hkv: int, group: int, device: torch.device, dtype: torch.dtype
) -> list[_LongChunk]:
    """Plan every long chunk of the step once (cached on meta)."""
    per_head = per_head_onednn(dtype, torch.device(device))
    key = ("long", page_size, hkv, group, per_head)
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
        head_scores = n * group * L
        on_head = per_head and MIN_HEAD_SCORES <= head_scores <= MAX_HEAD_SCORES
        if on_head or hkv * head_scores <= MAX_GEMM_SCORES:
            plans.append(_LongChunk(qsl[b], qsl[b + 1], L, pages, additive_mask(visible), None, on_head))
        else:
            plans.append(_LongChunk(qsl[b], qsl[b + 1], L, pages, None, visible, False))
    meta.plan_cache[key] = plans
    return plans


def attend_long(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, c: _LongChunk, scale: float, out: torch.Tensor
) -> None:
    _, _, hkv, d = k_cache.shape
    hq = q.shape[1]
    group, n, L = hq // hkv, c.end - c.start, c.seq_len
    k = gather_heads(k_cache, c.pages, c.buffers, "k")[:, :L]  # [Hkv, L, D]
    v = gather_heads(v_cache, c.pages, c.buffers, "v")[:, :L]
    if c.per_head:
        return _attend_per_head(
            q[c.start : c.end].view(n, hkv, group, d), k, v, c.bias, scale, out[c.start : c.end].view(n, hkv, group, d)
        )
    qf = q[c.start : c.end].view(n, hkv, group, d).transpose(0, 1).reshape(hkv, n * group, d)
    if c.bias is not None and q.dtype == torch.float32:
        scores = torch.baddbmm(c.bias, qf, k.transpose(1, 2), alpha=scale)  # [Hkv, n*G, L]
        o = torch.bmm(scores.softmax(-1), v)
    elif c.bias is not None:
        o = torch.bmm(masked_softmax(torch.bmm(qf, k.transpose(1, 2)), scale, c.bias, v.dtype), v)
    else:
        # With a mask and no enable_gqa, torch's CPU SDPA takes its flash kernel.
        o = F.scaled_dot_product_attention(qf, k, v, attn_mask=c.bool_mask, scale=scale)
    out[c.start : c.end] = o.view(hkv, n, group, d).transpose(0, 1).reshape(n, hq, d)


def _attend_per_head(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float, out: torch.Tensor
) -> None:
    """q, out: [n, Hkv, G, D]; k, v: [Hkv, L, D]. Per KV head: its G query heads folded into
    the rows ([n*G, D]); per block of HEAD_BLOCK_ROWS rows, scores over the keys the block's
    last query can see (the keys past it are masked for every row of the block), masked
    softmax, PV."""
    n, hkv, group, d = q.shape
    rows, L = n * group, k.shape[1]
    for h in range(hkv):
        qh = q[:, h].reshape(rows, d)
        oh = torch.empty_like(qh)
        for s in range(0, rows, HEAD_BLOCK_ROWS):
            e = min(rows, s + HEAD_BLOCK_ROWS)
            seen = L - n + (e - 1) // group + 1  # row r is query r // G, at position L - n + r // G
            scores = onednn.linear(qh[s:e], k[h, :seen])
            oh[s:e] = onednn.linear(masked_softmax(scores, scale, bias[s:e, :seen], q.dtype), v[h, :seen].t())
        out[:, h] = oh.view(n, group, d)
