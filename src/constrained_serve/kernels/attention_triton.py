"""Paged attention in Triton, for the GPU: the same layout and results as the torch path in
attention.py (whose docstring describes the layout). ``store_kv_triton`` writes new K/V into
their page slots; ``paged_attention_triton`` attends a mixed batch (varlen prefill chunks
and decodes, GQA), splitting long decodes over several programs (``default_num_splits``)
and reducing their partial results. Importable without triton: the functions then raise.
"""

from __future__ import annotations

import os

import torch

from ._triton import HAS_TRITON, require_triton, tl, triton  # noqa: F401
from .attention_metadata import AttentionMetadata
from .decode_split_triton import default_num_splits

if HAS_TRITON:
    from .attention_tile_triton import _attn_tile
    from .decode_split_triton import _paged_decode_split_kernel, _split_reduce_kernel


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


if HAS_TRITON:

    @triton.jit
    def _store_kv_kernel(
        k_ptr,
        v_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slot_ptr,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_ks,
        stride_kch,
        stride_vs,
        stride_vch,
        NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        # Padded tokens carry slot -1: nothing to write.
        if slot >= 0:
            offs_h = tl.arange(0, BLOCK_H)
            offs_d = tl.arange(0, HEAD_DIM)
            hmask = (offs_h < NUM_KV_HEADS)[:, None]
            k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=hmask)
            v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=hmask)
            tl.store(
                k_cache_ptr + slot * stride_ks + offs_h[:, None] * stride_kch + offs_d[None, :],
                k.to(k_cache_ptr.dtype.element_ty),
                mask=hmask,
            )
            tl.store(
                v_cache_ptr + slot * stride_vs + offs_h[:, None] * stride_vch + offs_d[None, :],
                v.to(v_cache_ptr.dtype.element_ty),
                mask=hmask,
            )

    @triton.jit
    def _paged_attn_kernel(
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        out_ptr,
        qsl_ptr,
        seq_lens_ptr,
        bt_ptr,
        scale_log2,
        seq_offset,
        stride_qt,
        stride_qh,
        stride_ot,
        stride_oh,
        stride_bt,
        stride_kp,
        stride_ks,
        stride_kh,
        stride_vp,
        stride_vs,
        stride_vh,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DOT_FP32: tl.constexpr,
    ):
        # Rows of a tile are (query token, head of the GQA group) pairs: the group's heads
        # share every K/V tile, and a decode still fills GROUP rows of the dot.
        b = tl.program_id(0) + seq_offset
        kvh = tl.program_id(1)
        qb = tl.program_id(2)
        BLOCK_Q: tl.constexpr = BLOCK_M // GROUP
        q_start = tl.load(qsl_ptr + b)
        q_len = tl.load(qsl_ptr + b + 1) - q_start
        if qb * BLOCK_Q < q_len:
            seq_len = tl.load(seq_lens_ptr + b)
            ctx = seq_len - q_len
            offs_m = tl.arange(0, BLOCK_M)
            tok = qb * BLOCK_Q + offs_m // GROUP
            head = kvh * GROUP + offs_m % GROUP
            row_ok = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
            offs_d = tl.arange(0, HEAD_DIM)
            row = (q_start + tok).to(tl.int64)
            q = tl.load(
                q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None],
                other=0.0,
            )
            q_pos = tl.where(row_ok, ctx + tok, -1)
            kv_end = tl.minimum(seq_len, ctx + (qb + 1) * BLOCK_Q)
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
            bt_row_ptr = bt_ptr + b.to(tl.int64) * stride_bt
            # Key tiles every row of the block sees (they end at or before the first row's
            # position) skip the causal mask; only the tiles on the diagonal apply it.
            full_end = tl.minimum(kv_end, ((ctx + qb * BLOCK_Q + 1) // BLOCK_N) * BLOCK_N)
            for phase in tl.static_range(2):  # unrolled: the mask is a compile-time choice
                if phase == 0:
                    lo, hi = 0, full_end
                else:
                    lo, hi = full_end, kv_end
                for start in range(lo, hi, BLOCK_N):
                    acc, m_i, l_i = _attn_tile(
                        q,
                        acc,
                        m_i,
                        l_i,
                        k_cache_ptr,
                        v_cache_ptr,
                        bt_row_ptr,
                        start,
                        kv_end,
                        q_pos,
                        kvh,
                        scale_log2,
                        stride_kp,
                        stride_ks,
                        stride_kh,
                        stride_vp,
                        stride_vs,
                        stride_vh,
                        HEAD_DIM,
                        PAGE_SIZE,
                        BLOCK_N,
                        phase == 1,
                        DOT_FP32,
                    )
            acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(
                out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                acc.to(out_ptr.dtype.element_ty),
                mask=row_ok[:, None],
            )


def store_kv_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Triton version of :func:`store_kv_torch`; slots < 0 are skipped (padding)."""
    require_triton()
    num_tokens, hkv, d = k.shape
    if num_tokens == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "K/V rows must be contiguous in head_dim"
    for cache in (k_cache, v_cache):  # slot = page * page_size + offset must be one stride
        assert cache.stride(-1) == 1 and cache.stride(0) == cache.shape[1] * cache.stride(1)
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=hkv,
        HEAD_DIM=d,
        BLOCK_H=_next_pow2(hkv),
    )


def triton_supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Shapes the Triton attention handles (others go to the reference): power-of-two
    head_dim >= 16 and page_size, unit stride along head_dim."""
    d, page_size = q.shape[-1], k_cache.shape[1]
    return (
        d >= 16
        and d & (d - 1) == 0
        and page_size & (page_size - 1) == 0
        and q.stride(-1) == 1
        and k_cache.stride(-1) == 1
    )


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    num_splits: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Triton version of :func:`paged_attention_torch`. Returns [num_tokens, Hq, D].

    ``num_splits`` > 1 runs the decode rows through the split-KV path; None picks it from
    host-side sizes (:func:`default_num_splits`: only for all-decode batches).
    ``block_m`` sets the rows per program of the prefill launch.
    """
    require_triton()
    num_tokens, hq, d = q.shape
    _, page_size, hkv, dk = k_cache.shape
    assert dk == d and hq % hkv == 0, "q/k head shapes disagree"
    assert d & (d - 1) == 0, "head_dim must be a power of two"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and q.stride(-1) == 1
    group = hq // hkv
    out = torch.empty_like(q)
    if num_tokens == 0 or meta.num_seqs == 0:
        return out
    interp = _interpreting()
    # The interpreter's tl.dot is wrong for bf16 (and fp16 only emulated): compute in fp32.
    dot_fp32 = interp or q.dtype == torch.float32 or k_cache.dtype == torch.float32
    scale_log2 = float(scale) * 1.4426950408889634
    if num_splits is None:
        num_splits = default_num_splits(meta, hkv)
    if block_n is None:
        block_n = 16 if interp else 64
    min_m = 1 if interp else 16  # tl.dot needs M >= 16 on the GPU
    k_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    v_strides = (v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))

    nd = meta.num_decodes
    npf = meta.num_seqs - nd
    common = dict(
        HEAD_DIM=d, PAGE_SIZE=page_size, BLOCK_N=block_n, DOT_FP32=dot_fp32, num_warps=num_warps, num_stages=num_stages
    )

    def launch(grid: tuple[int, int, int], first_seq: int, bm: int) -> None:
        """The tiled kernel over sequences first_seq.. (grid[0] of them), bm rows a tile."""
        _paged_attn_kernel[grid](
            q,
            k_cache,
            v_cache,
            out,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            scale_log2,
            first_seq,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            meta.block_tables.stride(0),
            *k_strides,
            *v_strides,
            GROUP=group,
            BLOCK_M=bm,
            **common,
        )

    # Decodes and prefill chunks are launched apart: a decode needs only its GQA group's rows
    # (a prefill tile of 64 rows would be mostly padding), and may split its KV range.
    if nd and num_splits > 1:
        bm = max(min_m, 16, _next_pow2(group))
        part_out = torch.empty(nd, hq, num_splits, d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(nd, hq, num_splits, dtype=torch.float32, device=q.device)
        _paged_decode_split_kernel[(nd, hkv, num_splits)](
            q,
            k_cache,
            v_cache,
            part_out,
            part_lse,
            meta.seq_lens,
            meta.block_tables,
            scale_log2,
            q.stride(0),
            q.stride(1),
            meta.block_tables.stride(0),
            *k_strides,
            *v_strides,
            GROUP=group,
            NUM_SPLITS=num_splits,
            BLOCK_M=bm,
            **common,
        )
        _split_reduce_kernel[(nd, hq)](
            part_out,
            part_lse,
            out,
            out.stride(0),
            out.stride(1),
            NUM_SPLITS=num_splits,
            SPLITS_P2=_next_pow2(num_splits),
            HEAD_DIM=d,
        )
    elif nd:
        launch((nd, hkv, 1), 0, max(min_m, _next_pow2(group)))
    if npf:
        # 64 rows of (token, group head) keep the fp32 accumulator in registers at head_dim 128.
        bm = max(min_m, _next_pow2(block_m or 64), _next_pow2(group))
        launch((npf, hkv, -(-meta.max_query_len // (bm // group))), nd, bm)
    return out
