"""Top-k sampling on GPU through the k best candidates (rows with 0 < top_k <= CANDIDATES_MAX).

The fused sampler (sampling.py) finds the top-k / top-p threshold without sorting: a radix
select of 8 passes over the whole vocabulary. On the H200 (2026-12-04, 256 rows x 128k vocab)
that took 6.5 ms against 1.1 ms for torch's ``topk(50)`` then softmax, sort and multinomial
over the 50: the passes are bound by compares against 16 candidate thresholds per token. A
row whose top_k is small never keeps more than its top_k best tokens (plus ties), so its
draw only needs those: ``torch.topk`` of the masked logits (one pass, well tuned), the full
row's normalizer (one ``logsumexp`` pass, for top-p's mass), then a small kernel over the
candidates that applies top-k, top-p and min-p exactly as the fused kernel does (every
token at or above the highest threshold is kept, ties included) and draws with the same
Gumbel noise, keyed by (seed, token id). A row's path depends on its own parameters only,
so a seeded request draws the same tokens whatever it is batched with.

Ties at the k-th value past the last candidate (possible with bf16 logits) would be lost:
``topk`` takes k_max + 1 candidates, and a row whose last candidate still equals its
threshold is redone by the fused kernel (a host check that costs no extra wait: the step
reads its tokens on the host right after).
"""

from __future__ import annotations

from typing import Any

import torch

from ._triton import HAS_TRITON, tl, triton
from .sampling_tensors import SamplingTensors
from .sampling_triton import apply_bitmask_triton, sample_fused_triton
from .transfer import to_device

# Rows with a top_k up to this take the candidate path on GPU.
CANDIDATES_MAX = 1024


def candidate_rows(temperatures: list[float], top_ks: list[int], vocab: int) -> list[int]:
    """Rows that sample (temperature > 0) with a top_k that the candidate path serves."""
    limit = min(CANDIDATES_MAX, vocab - 1)
    return [i for i, (t, k) in enumerate(zip(temperatures, top_ks)) if t > 0 and 0 < k <= limit]


if HAS_TRITON:

    @triton.jit
    def _candidates_kernel(
        vals_ptr,
        idx_ptr,
        lse_ptr,
        temp_ptr,
        top_k_ptr,
        top_p_ptr,
        min_p_ptr,
        seeds_ptr,
        out_ptr,
        overflow_ptr,
        K,
        stride,
        BLOCK_R: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_K)
        ok = cols[None, :] < K
        NEG_INF: tl.constexpr = float("-inf")
        # The candidates in descending order (torch.topk's sorted output), -inf past K.
        v = tl.load(vals_ptr + rows[:, None] * stride + cols[None, :], mask=ok, other=NEG_INF)
        ix = tl.load(idx_ptr + rows[:, None] * stride + cols[None, :], mask=ok, other=0).to(tl.int32)
        temp = tl.load(temp_ptr + rows)
        inv_t = 1.0 / tl.maximum(temp, 1.0e-6)
        top_k = tl.load(top_k_ptr + rows).to(tl.int32)
        top_p = tl.load(top_p_ptr + rows).to(tl.float32)
        min_p = tl.load(min_p_ptr + rows).to(tl.float32)
        seed = tl.load(seeds_ptr + rows).to(tl.int64)
        best = tl.max(v, 1)
        best_safe = tl.where(best == NEG_INF, 0.0, best)
        # top-k: the k-th best value; every candidate at or above it is kept.
        thr_k = tl.sum(tl.where(cols[None, :] == (top_k - 1)[:, None], v, 0.0), 1)
        last = tl.sum(tl.where(cols[None, :] == K - 1, v, 0.0), 1)
        overflow = (last == thr_k) & (K - 1 >= top_k)
        # top-p: the smallest prefix whose mass (of the whole row's, from its logsumexp)
        # reaches top_p; its last value is the threshold (ties after it are kept too).
        e = tl.where(ok & (v > NEG_INF), tl.exp((v - best_safe[:, None]) * inv_t[:, None]), 0.0)
        z = tl.exp(tl.load(lse_ptr + rows) - best_safe * inv_t)
        cum = tl.cumsum(e, 1)
        reached = (cum >= (top_p * z)[:, None]) & ok
        first = tl.min(tl.where(reached, cols[None, :], BLOCK_K), 1)
        thr_p = tl.sum(tl.where(cols[None, :] == first[:, None], v, 0.0), 1)
        thr_p = tl.where((top_p < 1.0) & (first < BLOCK_K), thr_p, NEG_INF)
        thr = tl.maximum(thr_k, thr_p)
        log_min_p = tl.where(min_p > 0.0, tl.log(tl.maximum(min_p, 1.0e-30)), NEG_INF)
        keep = ok & (v > NEG_INF) & (v >= thr[:, None])
        keep = keep & ((v - best_safe[:, None]) * inv_t[:, None] >= log_min_p[:, None])
        # The fused kernel's noise: Gumbel from tl.rand(seed, token id).
        u = tl.rand(tl.broadcast_to(seed[:, None], [BLOCK_R, BLOCK_K]), ix)
        u = tl.minimum(tl.maximum(u, 1.0e-20), 0.99999988)
        score = tl.where(keep, v * inv_t[:, None] - tl.log(-tl.log(u)), NEG_INF)
        pick = tl.argmax(score, 1)
        token = tl.sum(tl.where(cols[None, :] == pick[:, None], ix, 0), 1)
        tl.store(out_ptr + rows, token.to(tl.int64))
        tl.store(overflow_ptr + rows, overflow.to(tl.int8))


def sample_candidates(
    logits: torch.Tensor, bitmask: torch.Tensor | None, params: SamplingTensors, k_max: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens int64 [R], overflow bool [R]) for rows that all have 0 < top_k <= k_max and
    temperature > 0; an overflow row's token is not valid (see the module docstring)."""
    temperature, top_k, top_p, min_p, seeds = params

    R, V = logits.shape
    x = logits.float().clone() if logits.dtype == torch.float32 else logits.float()
    if bitmask is not None:
        apply_bitmask_triton(x, bitmask)
    inv_t = 1.0 / temperature.float().clamp_min(1.0e-6)
    lse = torch.logsumexp(x * inv_t[:, None], dim=-1)
    K = min(k_max + 1, V)
    vals, idx = x.topk(K, dim=-1)
    vals, idx = vals.contiguous(), idx.contiguous()
    out = torch.empty(R, dtype=torch.int64, device=logits.device)
    overflow = torch.empty(R, dtype=torch.int8, device=logits.device)
    block_k = max(16, 1 << (K - 1).bit_length())
    _candidates_kernel[(R,)](
        vals,
        idx,
        lse.contiguous(),
        temperature.float().contiguous(),
        top_k.contiguous(),
        top_p.contiguous(),
        min_p.contiguous(),
        seeds.contiguous(),
        out,
        overflow,
        K,
        vals.stride(0),
        BLOCK_R=1,
        BLOCK_K=block_k,
    )
    return out, overflow.bool()


def sample_with_candidates(
    logits: torch.Tensor,
    bitmask: torch.Tensor | None,
    params: SamplingTensors,
    candidates: tuple[list[int], int],
    **kernel_options: Any,
) -> torch.Tensor:
    """The candidate path for the candidate rows, then the fused kernel for every row, its
    filters off on the candidate rows the candidates decided (only its first pass runs there,
    and its token is dropped): the rare row whose ties overflow its candidates is redone by
    the fused kernel with its filters, all without the host looking at the device."""
    rows, k_max = candidates
    idx = to_device(torch.tensor(rows, dtype=torch.int64), logits.device)

    tokens, overflow = sample_candidates(
        logits.index_select(0, idx),
        None if bitmask is None else bitmask.index_select(0, idx),
        params.index_select(idx),
        k_max,
    )
    decided = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    decided[idx] = ~overflow
    out = sample_fused_triton(
        logits,
        bitmask,
        params._replace(
            top_k=torch.where(decided, 0, params.top_k),
            top_p=torch.where(decided, 1.0, params.top_p),
            min_p=torch.where(decided, 0.0, params.min_p),
        ),
        **kernel_options,
    )
    picked = torch.zeros_like(out)
    picked[idx] = tokens
    return torch.where(decided, picked, out)
