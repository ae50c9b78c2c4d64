"""Split-K decode in Triton: a long decode's keys split over several programs
(``default_num_splits``), each writing a partial result (output, max, sum) that a second
kernel reduces, so a batch of few long sequences still fills the GPU.
"""

from __future__ import annotations

from ._triton import HAS_TRITON, tl, triton  # noqa: F401
from .attention_metadata import AttentionMetadata

if HAS_TRITON:
    from .attention_tile_triton import _attn_tile


def default_num_splits(meta: AttentionMetadata, num_kv_heads: int, target_programs: int = 256) -> int:
    """Splits for an all-decode batch, from host-side sizes only (never probes the device).

    Enough programs to fill a large GPU (target_programs), but no split shorter than 256 keys.
    A CUDA graph fixes the count at capture (``meta.decode_splits``): the kernel sizes each
    split from the device-side sequence lengths, and empty splits weigh nothing in the reduce.
    """
    if meta.decode_splits is not None:
        return meta.decode_splits
    if meta.num_decodes != meta.num_seqs or meta.num_seqs == 0:
        return 1
    programs = meta.num_seqs * num_kv_heads
    by_occupancy = -(-target_programs // programs)
    by_length = max(1, meta.max_seq_len // 256)
    return int(max(1, min(by_occupancy, by_length, 32)))


if HAS_TRITON:

    @triton.jit
    def _paged_decode_split_kernel(
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        part_out_ptr,
        part_lse_ptr,
        seq_lens_ptr,
        bt_ptr,
        scale_log2,
        stride_qt,
        stride_qh,
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
        NUM_SPLITS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DOT_FP32: tl.constexpr,
    ):
        # Split-KV decode: few sequences x long contexts leave most SMs idle with one program
        # per (sequence, kv head); each split here covers a slice of the context instead.
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        sp = tl.program_id(2)
        seq_len = tl.load(seq_lens_ptr + b)
        chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = sp * chunk
        end = tl.minimum(seq_len, start + chunk)
        offs_m = tl.arange(0, BLOCK_M)
        head = kvh * GROUP + offs_m
        row_ok = offs_m < GROUP
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(
            q_ptr + b.to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
            mask=row_ok[:, None],
            other=0.0,
        )
        q_pos = tl.where(row_ok, seq_len - 1, -1)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        bt_row_ptr = bt_ptr + b.to(tl.int64) * stride_bt
        for s in range(start, end, BLOCK_N):
            acc, m_i, l_i = _attn_tile(
                q,
                acc,
                m_i,
                l_i,
                k_cache_ptr,
                v_cache_ptr,
                bt_row_ptr,
                s,
                end,
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
                False,
                DOT_FP32,
            )
        has = l_i > 0
        acc = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        # part_out: [B, Hq, NUM_SPLITS, D] fp32, part_lse: [B, Hq, NUM_SPLITS] fp32
        base = (b.to(tl.int64) * (tl.num_programs(1) * GROUP) + head) * NUM_SPLITS + sp
        tl.store(part_out_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_lse_ptr + base, lse, mask=row_ok)

    @triton.jit
    def _split_reduce_kernel(
        part_out_ptr,
        part_lse_ptr,
        out_ptr,
        stride_ot,
        stride_oh,
        NUM_SPLITS: tl.constexpr,
        SPLITS_P2: tl.constexpr,
        HEAD_DIM: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, SPLITS_P2)
        offs_d = tl.arange(0, HEAD_DIM)
        base = (b.to(tl.int64) * tl.num_programs(1) + h) * NUM_SPLITS
        smask = offs_s < NUM_SPLITS
        lse = tl.load(part_lse_ptr + base + offs_s, mask=smask, other=float("-inf"))
        m = tl.max(lse, 0)
        w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - m))
        parts = tl.load(
            part_out_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :], mask=smask[:, None], other=0.0
        )
        o = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
        tl.store(out_ptr + b.to(tl.int64) * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty))
