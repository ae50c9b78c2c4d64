"""Paged attention over the KV page pool for one flat, mixed batch.

Layout (shared by every implementation):
  q:            [num_tokens, num_q_heads, head_dim]   flat batch, sequences back to back
  k_cache/v_cache: [num_pages, page_size, num_kv_heads, head_dim]  one layer's pages (contiguous,
                   or a view of head-major storage on CPU: kv_layout.py)
  meta.query_start_loc: int32 [B+1]   chunk of sequence b is q[qsl[b]:qsl[b+1]]
  meta.seq_lens:        int32 [B]     context length *after* this step (cached + chunk)
  meta.block_tables:    int32 [B, max_pages]  page ids of each sequence, in order
  meta.slot_mapping:    int64 [num_tokens]    page * page_size + offset of each new token
Decode sequences (chunk of 1) come first in the batch: meta.num_decodes of them.
Query token j of a chunk of length n sits at position seq_len - n + j and attends causally
to every key at a position <= its own.
"""

from __future__ import annotations

from typing import Any

import torch

from . import native_decode
from .attention_metadata import AttentionMetadata
from .kv_layout import heads_view
from .long_chunks import attend_long, long_chunks
from .short_rows import attend_short, short_groups


def store_kv_torch(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write the new tokens' K/V ([T, Hkv, D]) into their slots of the page pool, in place."""
    num_pages, page_size, hkv, d = k_cache.shape
    for new, cache in ((k, k_cache), (v, v_cache)):
        heads = heads_view(cache)
        if heads is not None:  # head-major storage (kv_layout.py)
            heads.index_copy_(1, slot_mapping, new.to(cache.dtype).transpose(0, 1))
        else:
            cache.view(num_pages * page_size, hkv, d).index_copy_(0, slot_mapping, new.to(cache.dtype))


def paged_attention_torch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Reference implementation (and the CPU path). Returns [num_tokens, Hq, D]."""
    num_tokens, hq, d = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    out = torch.empty_like(q)
    # Decode rows and chunks of up to 4 tokens: read in place by the native kernel where it runs
    # (fp32 or bf16, head-major pool). The other short chunks (and every short row where it does
    # not run) are gathered and attended in batched GEMMs.
    min_len = 1
    if native_decode.supports(q, k_cache, v_cache):
        native_decode.attend_rows(q, k_cache, v_cache, meta, scale, out)
        min_len = native_decode.MAX_CHUNK + 1
    for g in short_groups(meta, page_size, group, q.device, min_len):
        attend_short(q, k_cache, v_cache, g, scale, out)
    for c in long_chunks(meta, page_size, hkv, group, q.device, q.dtype):
        attend_long(q, k_cache, v_cache, c, scale, out)
    return out


# The GPU path, in its own file; its names stay importable from here, imported on first use:
# importing Triton costs 0.3 s, which a process that never runs a Triton kernel (the CPU
# path: a CLI run, a notebook, each Ray replica) should not pay.
TRITON_NAMES = ("HAS_TRITON", "default_num_splits", "paged_attention_triton", "store_kv_triton", "triton_supports")


def __getattr__(name: str) -> Any:
    if name in TRITON_NAMES:
        from . import attention_triton

        return getattr(attention_triton, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["paged_attention_torch", "store_kv_torch", *TRITON_NAMES]
