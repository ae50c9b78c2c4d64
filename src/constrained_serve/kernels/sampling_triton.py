"""The fused Triton sampler (GPU) of sampling.py: the same arguments and results as
``sample_torch``. Importable without triton: the functions then raise.

The fused sampler never sorts the vocabulary. top-k, top-p and min-p each keep exactly the
tokens whose logit is >= some threshold, so the kept set is {logit >= max(thresholds)}:
  min-p: closed form from the row max;
  top-k / top-p: a radix select on the order-preserving integer key of the fp32 logit,
  4 bits per pass (8 passes), counting tokens / summing probability mass above 16
  candidate thresholds at once.
The draw is Gumbel-max: argmax(logit / T + G) with G = -log(-log(U)), U = tl.rand(seed, tok),
i.e. the same law as the reference's argmax(p / E), E ~ Exp(1).
Passes over the vocab per row: 1 (greedy or plain sampling, min-p needs 2), 10 with top-k/p.
Rows with 0 < top_k <= 1024 skip the search: sampling_candidates.py draws them from torch.topk's
candidates with the same thresholds and noise (``sampling.sample_triton`` picks the path per row;
this module knows nothing of it).
Ties exactly at a top-k/top-p threshold are all kept, as in the reference; the noise stream
differs from the reference's torch generator, so the two agree in distribution, not draw
for draw.
"""

from __future__ import annotations

import torch

from ._triton import HAS_TRITON, require_triton, tl, triton  # noqa: F401
from .sampling_tensors import SamplingTensors

if HAS_TRITON:

    @triton.jit
    def _masked_tile(logits_ptr, bitmask_ptr, rows, row_ok, offs, V, stride_l, stride_b, HAS_MASK: tl.constexpr):
        """fp32 logits [rows, block] with -inf where the bitmask bit is 0 (or out of range)."""
        ok = row_ok[:, None] & (offs < V)[None, :]
        x = tl.load(logits_ptr + rows[:, None] * stride_l + offs[None, :], mask=ok, other=float("-inf")).to(tl.float32)
        if HAS_MASK:
            words = tl.load(bitmask_ptr + rows[:, None] * stride_b + (offs // 32)[None, :], mask=ok, other=0)
            allowed = ((words >> (offs % 32)[None, :]) & 1) != 0
            x = tl.where(allowed & ok, x, float("-inf"))
        return x

    @triton.jit
    def _gumbel(seed, offs, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
        """Gumbel noise [rows, block] from each row's seed and the token index (batch independent)."""
        u = tl.rand(
            tl.broadcast_to(seed[:, None], [BLOCK_R, BLOCK_V]), tl.broadcast_to(offs[None, :], [BLOCK_R, BLOCK_V])
        )
        # Keep -log(u) finite and > 0: u = 0 and u rounding to 1.0 are both possible in fp32.
        u = tl.minimum(tl.maximum(u, 1.0e-20), 0.99999988)
        return -tl.log(-tl.log(u))

    @triton.jit
    def _order_key(x):
        """fp32 -> int64 in [0, 2^32) with the same order as the floats."""
        bits = x.to(tl.int32, bitcast=True)
        return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64) + 2147483648

    @triton.jit
    def _row_argmax(x, start, best, best_idx):
        """Running (max, first index of max) over column blocks; x is [rows, block]."""
        bmax = tl.max(x, 1)
        bidx = tl.argmax(x, 1).to(tl.int32)
        best_idx = tl.where(bmax > best, start + bidx, best_idx)
        return tl.maximum(best, bmax), best_idx

    @triton.jit
    def _apply_bitmask_kernel(logits_ptr, bitmask_ptr, V, stride_l, stride_b, BLOCK_V: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        in_v = offs < V
        words = tl.load(bitmask_ptr + row * stride_b + offs // 32, mask=in_v, other=-1)
        banned = (((words >> (offs % 32)) & 1) == 0) & in_v
        # Only banned tokens are written: an all-ones row costs no stores.
        tl.store(
            logits_ptr + row * stride_l + offs,
            tl.full([BLOCK_V], float("-inf"), logits_ptr.dtype.element_ty),
            mask=banned,
        )

    @triton.jit
    def _sample_kernel(
        logits_ptr,
        bitmask_ptr,
        temp_ptr,
        top_k_ptr,
        top_p_ptr,
        min_p_ptr,
        seeds_ptr,
        out_ptr,
        R,
        V,
        stride_l,
        stride_b,
        HAS_MASK: tl.constexpr,
        ALL_GREEDY: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_V: tl.constexpr,
        SEARCH_BLOCK: tl.constexpr,
    ):
        # BLOCK_R rows per program: 1 on the GPU (a row per program, long vocab loops); the
        # interpreter runs much faster with many rows per program.
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < R
        arange = tl.arange(0, BLOCK_V)
        NEG_INF: tl.constexpr = float("-inf")

        # Pass 1: masked max / argmax (greedy) and, when sampling, the softmax normalizer and
        # the unfiltered Gumbel argmax (the answer when no top-k/top-p/min-p applies).
        best = tl.full([BLOCK_R], NEG_INF, tl.float32)
        best_idx = tl.zeros([BLOCK_R], tl.int32)
        if ALL_GREEDY:
            for start in range(0, V, BLOCK_V):
                x = _masked_tile(logits_ptr, bitmask_ptr, rows, row_ok, start + arange, V, stride_l, stride_b, HAS_MASK)
                best, best_idx = _row_argmax(x, start, best, best_idx)
            tl.store(out_ptr + rows, best_idx.to(tl.int64), mask=row_ok)
        else:
            temp = tl.load(temp_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
            inv_t = 1.0 / tl.maximum(temp, 1.0e-6)
            seed = tl.load(seeds_ptr + rows, mask=row_ok, other=0).to(tl.int64)
            z = tl.zeros([BLOCK_R], tl.float32)
            g_best = tl.full([BLOCK_R], NEG_INF, tl.float32)
            g_idx = tl.zeros([BLOCK_R], tl.int32)
            for start in range(0, V, BLOCK_V):
                offs = start + arange
                x = _masked_tile(logits_ptr, bitmask_ptr, rows, row_ok, offs, V, stride_l, stride_b, HAS_MASK)
                old = best
                best, best_idx = _row_argmax(x, start, best, best_idx)
                m_safe = tl.where(best == NEG_INF, 0.0, best)
                z = z * tl.exp((old - m_safe) * inv_t) + tl.sum(tl.exp((x - m_safe[:, None]) * inv_t[:, None]), 1)
                score = tl.where(x > NEG_INF, x * inv_t[:, None] + _gumbel(seed, offs, BLOCK_R, BLOCK_V), NEG_INF)
                g_best, g_idx = _row_argmax(score, start, g_best, g_idx)

            top_k = tl.load(top_k_ptr + rows, mask=row_ok, other=0).to(tl.int32)
            top_p = tl.load(top_p_ptr + rows, mask=row_ok, other=1.0).to(tl.float32)
            min_p = tl.load(min_p_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
            sampling = temp > 0
            use_k = (top_k > 0) & (top_k < V)
            use_p = top_p < 1.0
            use_min = min_p > 0.0
            # Disabled searches get unreachable targets, so their threshold stays at 0 (keep all).
            k_eff = tl.where(use_k, top_k, V + 1)
            mass_target = tl.where(use_p, top_p * z, float("inf"))
            best_safe = tl.where(best == NEG_INF, 0.0, best)
            thr_k = tl.zeros([BLOCK_R], tl.int64)
            thr_p = tl.zeros([BLOCK_R], tl.int64)
            need_search = sampling & (use_k | use_p)
            if tl.max(need_search.to(tl.int32), 0) > 0:
                s_arange = tl.arange(0, SEARCH_BLOCK)
                digits = tl.arange(0, 16).to(tl.int64)
                for i in tl.static_range(8):
                    shift = 28 - 4 * i
                    cand_k = thr_k[:, None] + (digits << shift)[None, :]  # [R, 16]
                    cand_p = thr_p[:, None] + (digits << shift)[None, :]
                    cnt = tl.zeros([BLOCK_R, 16], tl.int32)
                    mass = tl.zeros([BLOCK_R, 16], tl.float32)
                    for start in range(0, V, SEARCH_BLOCK):
                        x = _masked_tile(
                            logits_ptr, bitmask_ptr, rows, row_ok, start + s_arange, V, stride_l, stride_b, HAS_MASK
                        )
                        ok = x > NEG_INF
                        key = _order_key(x)[:, :, None]
                        e = tl.exp((x - best_safe[:, None]) * inv_t[:, None])
                        cnt += tl.sum(((key >= cand_k[:, None, :]) & ok[:, :, None]).to(tl.int32), 1)
                        mass += tl.sum(tl.where(key >= cand_p[:, None, :], e[:, :, None], 0.0), 1)
                    # Counts / masses fall as the candidate rises: keep the last one on target.
                    jk = tl.maximum(tl.sum((cnt >= k_eff[:, None]).to(tl.int32), 1) - 1, 0)
                    jp = tl.maximum(tl.sum((mass >= mass_target[:, None]).to(tl.int32), 1) - 1, 0)
                    thr_k = thr_k + (jk.to(tl.int64) << shift)
                    thr_p = thr_p + (jp.to(tl.int64) << shift)
            need_filter = sampling & (use_k | use_p | use_min)
            if tl.max(need_filter.to(tl.int32), 0) > 0:
                thr = tl.maximum(thr_k, thr_p)
                log_min_p = tl.where(use_min, tl.log(tl.maximum(min_p, 1.0e-30)), NEG_INF)
                f_best = tl.full([BLOCK_R], NEG_INF, tl.float32)
                f_idx = tl.zeros([BLOCK_R], tl.int32)
                for start in range(0, V, BLOCK_V):
                    offs = start + arange
                    x = _masked_tile(logits_ptr, bitmask_ptr, rows, row_ok, offs, V, stride_l, stride_b, HAS_MASK)
                    keep = (x > NEG_INF) & (_order_key(x) >= thr[:, None])
                    keep = keep & ((x - best_safe[:, None]) * inv_t[:, None] >= log_min_p[:, None])
                    score = tl.where(keep, x * inv_t[:, None] + _gumbel(seed, offs, BLOCK_R, BLOCK_V), NEG_INF)
                    f_best, f_idx = _row_argmax(score, start, f_best, f_idx)
                g_idx = tl.where(need_filter & (f_best > NEG_INF), f_idx, g_idx)
            tl.store(out_ptr + rows, tl.where(sampling, g_idx, best_idx).to(tl.int64), mask=row_ok)


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def apply_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, *, block_v: int = 1024) -> torch.Tensor:
    """Triton version of :func:`apply_bitmask_torch` (in place, returns logits)."""
    require_triton()
    R, V = logits.shape
    assert bitmask.shape[0] == R and bitmask.shape[1] * 32 >= V, "bitmask must be [R, ceil(V/32)]"
    assert logits.stride(-1) == 1 and bitmask.stride(-1) == 1
    if R == 0:
        return logits
    _apply_bitmask_kernel[(R, triton.cdiv(V, block_v))](
        logits, bitmask, V, logits.stride(0), bitmask.stride(0), BLOCK_V=block_v
    )
    return logits


def sample_fused_triton(
    logits: torch.Tensor,
    bitmask: torch.Tensor | None,
    params: SamplingTensors,
    *,
    all_greedy: bool = False,
    block_v: int | None = None,
    search_block: int | None = None,
    rows_per_program: int | None = None,
    num_warps: int = 8,
) -> torch.Tensor:
    """Fused Triton version of :func:`sample_torch`: one program per row, no host sync.

    Same arguments and result (int64 [R]); logits are read, never written. Every row takes
    the threshold search (``sampling.sample_triton`` sends small-top-k rows to the candidate
    path first).
    """
    require_triton()
    R, V = logits.shape
    assert logits.stride(-1) == 1
    out = torch.empty(R, dtype=torch.int64, device=logits.device)
    if R == 0:
        return out
    has_mask = bitmask is not None
    if has_mask:
        assert bitmask.shape[0] == R and bitmask.shape[1] * 32 >= V, "bitmask must be [R, ceil(V/32)]"
        assert bitmask.stride(-1) == 1
    interp = _interpreting()
    if block_v is None:
        block_v = min(1024 if not interp else 256, max(16, 1 << (V - 1).bit_length()))
    if search_block is None:
        # The search holds [block, 16] tiles: a smaller block keeps them in registers.
        search_block = min(256 if not interp else 128, block_v)
    if rows_per_program is None:
        rows_per_program = 1 if not interp else min(256, 1 << (R - 1).bit_length())
    bm = bitmask if has_mask else logits
    _sample_kernel[(triton.cdiv(R, rows_per_program),)](
        logits,
        bm,
        *params,
        out,
        R,
        V,
        logits.stride(0),
        bm.stride(0) if has_mask else 0,
        HAS_MASK=has_mask,
        ALL_GREEDY=bool(all_greedy),
        BLOCK_R=rows_per_program,
        BLOCK_V=block_v,
        SEARCH_BLOCK=search_block,
        num_warps=num_warps,
    )
    return out
