"""The Triton attention tile both paged-attention kernels share: one block of queries
against one page-sized block of keys, with the online-softmax update (running max and sum).
"""

from __future__ import annotations

from ._triton import HAS_TRITON, tl, triton  # noqa: F401

if HAS_TRITON:

    @triton.jit
    def _attn_tile(
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
        HEAD_DIM: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr,
        DOT_FP32: tl.constexpr,
    ):
        """One BLOCK_N tile of keys: online-softmax update of (acc, m_i, l_i), log2 domain."""
        offs_d = tl.arange(0, HEAD_DIM)
        offs_n = start + tl.arange(0, BLOCK_N)
        n_valid = offs_n < kv_end
        # Per-key page lookup, so BLOCK_N is free of the page size.
        page = tl.load(bt_row_ptr + offs_n // PAGE_SIZE, mask=n_valid, other=0).to(tl.int64)
        in_page = offs_n % PAGE_SIZE
        # K rows are loaded [N, D] (contiguous along D, coalesced) and transposed for the dot.
        k = tl.load(
            k_cache_ptr + page[:, None] * stride_kp + in_page[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :],
            mask=n_valid[:, None],
            other=0.0,
        )
        if DOT_FP32:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale_log2
        if CAUSAL:
            keep = (offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :]
        else:
            keep = n_valid[None, :] & (q_pos[:, None] >= 0)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing visible yet keeps m = -inf; shift by 0 to avoid inf - inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + page[:, None] * stride_vp + in_page[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :],
            mask=n_valid[:, None],
            other=0.0,
        )
        if DOT_FP32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        return acc, m_new, l_i
