"""Paged attention over the KV page pool for one flat, mixed batch.

Layout (shared by every implementation):
  q:            [num_tokens, num_q_heads, head_dim]   flat batch, sequences back to back
  k_cache/v_cache: [num_pages, page_size, num_kv_heads, head_dim]  one layer's pages
  meta.query_start_loc: int32 [B+1]   chunk of sequence b is q[qsl[b]:qsl[b+1]]
  meta.seq_lens:        int32 [B]     context length *after* this step (cached + chunk)
  meta.block_tables:    int32 [B, max_pages]  page ids of each sequence, in order
  meta.slot_mapping:    int64 [num_tokens]    page * page_size + offset of each new token
Decode sequences (chunk of 1) come first in the batch: meta.num_decodes of them.
Query token j of a chunk of length n sits at position seq_len - n + j and attends causally
to every key at a position <= its own.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    # Host copies, so the CPU path never syncs on a device tensor.
    query_lens_host: list[int]
    seq_lens_host: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)


def store_kv_torch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Write the new tokens' K/V ([T, Hkv, D]) into their slots of the page pool, in place."""
    num_pages, page_size, hkv, d = k_cache.shape
    k_cache.view(num_pages * page_size, hkv, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(num_pages * page_size, hkv, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather(cache: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    """[num_pages_used] page ids -> contiguous [length, Hkv, D]."""
    _, page_size, hkv, d = cache.shape
    return cache.index_select(0, pages).view(-1, hkv, d)[:length]


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Reference implementation (and the CPU path). Returns [num_tokens, Hq, D]."""
    num_tokens, hq, d = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    out = torch.empty_like(q)
    nd = meta.num_decodes

    if nd:
        # All decode rows at once: gather their pages padded to the longest, mask the tail.
        max_len = max(meta.seq_lens_host[:nd])
        npages = -(-max_len // page_size)
        pages = meta.block_tables[:nd, :npages]
        k = k_cache.index_select(0, pages.reshape(-1)).view(nd, npages * page_size, hkv, d)
        v = v_cache.index_select(0, pages.reshape(-1)).view(nd, npages * page_size, hkv, d)
        qd = q[:nd].view(nd, hkv, group, d).float()
        scores = torch.einsum("bhgd,blhd->bhgl", qd, k.float()) * scale
        pos = torch.arange(npages * page_size, device=q.device)
        valid = pos[None, :] < meta.seq_lens[:nd, None].to(pos.dtype)
        scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[:nd] = torch.einsum("bhgl,blhd->bhgd", probs, v.float()).reshape(nd, hq, d).to(q.dtype)

    starts = meta.query_start_loc
    qsl = [0]
    for n in meta.query_lens_host:
        qsl.append(qsl[-1] + n)
    for b in range(nd, meta.num_seqs):
        s, e = qsl[b], qsl[b + 1]
        n, L = e - s, meta.seq_lens_host[b]
        pages = meta.block_tables[b, : -(-L // page_size)]
        k = _gather(k_cache, pages, L).transpose(0, 1)  # [Hkv, L, D]
        v = _gather(v_cache, pages, L).transpose(0, 1)
        qb = q[s:e].transpose(0, 1)  # [Hq, n, D]
        if n == L:
            mask = None
            causal = True
        else:
            # Query j (position L-n+j) sees keys 0..L-n+j.
            qpos = torch.arange(L - n, L, device=q.device)
            mask = torch.arange(L, device=q.device)[None, :] <= qpos[:, None]
            causal = False
        o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                           enable_gqa=group > 1)
        out[s:e] = o.transpose(0, 1)
    del starts
    return out
