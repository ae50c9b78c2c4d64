"""Masked sampling: packed int32 token bitmask, temperature, top-k/top-p/min-p, seeded draws.

Bitmask: int32 [rows, ceil(vocab/32)]; bit (t % 32) of word (t // 32) set means token t is
allowed. A row of all ones (-1) leaves the logits untouched (rows without a grammar).
Seeds: int64 [rows], one per row *and step* (the caller mixes the request seed with the
output position), so a row's draw does not depend on what else is in the batch.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from . import native_fused
from .sampling_tensors import SamplingTensors

# The Triton sampler's names stay importable from here, imported on first use (Triton's
# import costs 0.3 s that the CPU path never needs; see attention.py).
TRITON_NAMES = ("HAS_TRITON", "apply_bitmask_triton", "sample_fused_triton")


def __getattr__(name: str) -> Any:
    if name in TRITON_NAMES:
        from . import sampling_triton

        return getattr(sampling_triton, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_BITS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [R, W] -> bool [R, vocab_size] (True = allowed)."""
    bits = _BITS.to(bitmask.device)
    allowed = (bitmask.unsqueeze(-1) >> bits) & 1
    return allowed.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


# Row b of this table is the additive mask of one bitmask byte b: 0 for a set bit, -inf else.
_BYTE_MASKS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _byte_masks(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    table = _BYTE_MASKS.get((device, dtype))
    if table is None:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        table = torch.zeros(256, 8).masked_fill_(bits == 0, float("-inf")).to(device, dtype)
        _BYTE_MASKS[(device, dtype)] = table
    return table


def apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """In place: logits[r, t] = -inf where the bit is 0. Returns logits.

    Adds an additive mask looked up byte by byte (bits 8k..8k+7 of a little-endian word are
    its byte k, so the bytes of a row, in memory order, cover tokens 8 at a time) instead of
    ``masked_fill_`` with the unpacked bool mask: on CPU that took 8 ms for 64 rows of a
    49k vocabulary, the lookup and add take 2 ms (measured on the project's 2-core VM)."""
    if sys.byteorder != "little":
        logits.masked_fill_(~unpack_bitmask(bitmask, logits.shape[-1]), float("-inf"))
        return logits
    rows, vocab = logits.shape
    masks = _byte_masks(logits.device, logits.dtype)
    add = masks.index_select(0, bitmask.contiguous().view(torch.uint8).reshape(-1).long())
    logits.add_(add.view(rows, -1)[:, :vocab])
    return logits


def _exponential_noise(seeds: list[int], sampled: list[bool], vocab: int, device: torch.device) -> torch.Tensor:
    """Per-row Exp(1) noise from per-row generators (reproducible, batch independent), for the
    rows that sample; a greedy row (``sampled`` False) gets ones, its draw being unused.

    Exp(1) as -log(U), U ~ Uniform[0, 1) from ``uniform_``: on CPU torch's ``exponential_``
    with a generator runs element by element, 1.2 ms a row of a 49k vocabulary on one thread
    (39 ms a step for 32 sampled rows, a fifth of a step of the default model), where
    ``uniform_`` and a vectorized log take 0.27 ms. U = 0 gives +inf noise: that token's
    p / E is 0, it is not drawn (probability 2^-24 a token, as a float32 uniform allows)."""
    noise = torch.empty(len(seeds), vocab, device=device)
    for r, (s, draw) in enumerate(zip(seeds, sampled)):
        if draw:
            g = torch.Generator(device=device)
            g.manual_seed(s & 0x7FFF_FFFF_FFFF_FFFF)
            noise[r].uniform_(generator=g).log_().neg_()
        else:
            noise[r].fill_(1.0)
    # U < 1, so the noise is > 0: p / 0 would pick even a zero-probability token. Kept as a guard.
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim (the first index of the maximum, as argmax). On CPU, fp32 rows
    go through a native pass (native_fused.argmax_rows: 64 x 49152, 2 threads, about 0.3 ms);
    otherwise ``max(dim).indices``, 2.5x faster than ``argmax`` on CPU (0.94 vs 2.36 ms) with
    the same indices, ties, -inf rows and NaN included (checked)."""
    if x.dim() == 2 and x.dtype == torch.float32 and native_fused.applies(x):
        return native_fused.argmax_rows(x)
    return x.max(dim=-1).indices


def greedy_masked(logits: torch.Tensor, bitmask: torch.Tensor | None) -> torch.Tensor:
    """argmax over each row's allowed tokens, masking only the rows that need it.

    A row whose unmasked argmax is allowed has that token as its masked argmax too (ties
    included: no earlier token has the same value, or argmax would have returned it). A model
    that follows its grammar mostly wants an allowed token, so most rows skip the copy of
    their logits and the mask, which on CPU cost more than the rest of the step's sampling
    (~12 MB of each per 64 rows of a 49k vocabulary)."""
    tokens = row_argmax(logits)
    if bitmask is None:
        return tokens
    words = bitmask.gather(1, (tokens >> 5).unsqueeze(1)).squeeze(1)
    allowed = ((words >> (tokens & 31).to(words.dtype)) & 1).bool()
    if bool(allowed.all()):
        return tokens
    bad = (~allowed).nonzero().squeeze(1)
    rows = logits.index_select(0, bad).float()
    apply_bitmask_torch(rows, bitmask.index_select(0, bad))
    tokens[bad] = row_argmax(rows)
    return tokens


def sample_torch(
    logits: torch.Tensor, bitmask: torch.Tensor | None, params: SamplingTensors, *, all_greedy: bool = False
) -> torch.Tensor:
    """Reference implementation (and the CPU path). logits [R, V] (any float) -> int64 [R].

    Greedy where temperature == 0 (every row with ``all_greedy``, which reads no ``params``).
    Otherwise logits / T, then top-k, top-p, min-p filtering, then a Gumbel-max style draw:
    argmax(p / E) with E ~ Exp(1) is a draw from p.
    """
    if all_greedy:
        return greedy_masked(logits, bitmask)
    temperature, top_k, top_p, min_p, seeds = params
    # Always a copy: the mask is applied in place and must not leak into the caller's logits.
    logits = logits.to(torch.float32, copy=True)
    if bitmask is not None:
        apply_bitmask_torch(logits, bitmask)
    greedy_tokens = row_argmax(logits)
    temp = temperature.float().clamp_min(1e-6)[:, None]
    probs = torch.softmax(logits / temp, dim=-1)
    R, V = probs.shape
    need_sort = bool(((top_k > 0) & (top_k < V)).any() or (top_p < 1.0).any())
    if need_sort:
        # top-k and top-p each keep the tokens at or above a threshold probability, so ties
        # at the threshold are all kept, as in HF's warpers, vLLM and the Triton kernel.
        sorted_p = probs.sort(dim=-1, descending=True).values
        k = torch.where(top_k > 0, top_k, V).clamp(1, V)[:, None]
        # top-p: the smallest prefix whose mass reaches top_p (always at least one token).
        # Only where asked: with top_p == 1, fp32 rounding can push cum past 1 and drop the tail.
        in_p = (sorted_p.cumsum(dim=-1) - sorted_p) < top_p.float()[:, None]
        n_p = torch.where(top_p < 1.0, in_p.sum(dim=-1).clamp_min(1), V)[:, None]
        thresh = sorted_p.gather(1, torch.minimum(k, n_p) - 1)
        probs = probs.masked_fill(probs < thresh, 0.0)
    if (min_p > 0).any():
        thresh = probs.max(dim=-1, keepdim=True).values * min_p.float()[:, None]
        probs = probs.masked_fill(probs < thresh, 0.0)
    noise = _exponential_noise(seeds.tolist(), (temperature > 0).tolist(), V, probs.device)
    sampled = row_argmax(probs / noise)
    return torch.where(temperature == 0, greedy_tokens, sampled)


def sample_triton(
    logits: torch.Tensor,
    bitmask: torch.Tensor | None,
    params: SamplingTensors,
    *,
    all_greedy: bool = False,
    candidates: tuple[list[int], int] | None = None,
    **kernel_options: int | None,
) -> torch.Tensor:
    """The GPU sampler, same arguments and result as :func:`sample_torch`: the fused Triton
    kernel (sampling_triton.py), after ``candidates`` (rows, their largest top_k) drew
    from their top-k candidates (sampling_candidates.py). ``kernel_options``: the fused
    kernel's block sizes and warps."""
    from .sampling_triton import require_triton, sample_fused_triton  # Triton's import: only here

    require_triton()
    if candidates is not None and candidates[0] and not all_greedy:
        from .sampling_candidates import sample_with_candidates

        return sample_with_candidates(logits, bitmask, params, candidates, **kernel_options)
    return sample_fused_triton(logits, bitmask, params, all_greedy=all_greedy, **kernel_options)
