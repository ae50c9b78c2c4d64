"""Masked sampling: packed int32 token bitmask, temperature, top-k/top-p/min-p, seeded draws.

Bitmask: int32 [rows, ceil(vocab/32)]; bit (t % 32) of word (t // 32) set means token t is
allowed. A row of all ones (-1) leaves the logits untouched (rows without a grammar).
Seeds: int64 [rows], one per row *and step* (the caller mixes the request seed with the
output position), so a row's draw does not depend on what else is in the batch.
"""
from __future__ import annotations

import torch

_BITS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [R, W] -> bool [R, vocab_size] (True = allowed)."""
    bits = _BITS.to(bitmask.device)
    allowed = (bitmask.unsqueeze(-1) >> bits) & 1
    return allowed.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """In place: logits[r, t] = -inf where the bit is 0. Returns logits."""
    allowed = unpack_bitmask(bitmask, logits.shape[-1])
    logits.masked_fill_(~allowed, float("-inf"))
    return logits


def _exponential_noise(seeds: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """Per-row Exp(1) noise from per-row generators (reproducible, batch independent)."""
    noise = torch.empty(len(seeds), vocab, device=device)
    for r, s in enumerate(seeds):
        g = torch.Generator(device=device)
        g.manual_seed(s & 0x7FFF_FFFF_FFFF_FFFF)
        noise[r].exponential_(generator=g)
    return noise


def sample_torch(logits: torch.Tensor, bitmask: torch.Tensor | None, temperature: torch.Tensor,
                 top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                 seeds: torch.Tensor, *, all_greedy: bool = False) -> torch.Tensor:
    """Reference implementation (and the CPU path). logits [R, V] (any float) -> int64 [R].

    Greedy where temperature == 0. Otherwise logits / T, then top-k, top-p, min-p filtering,
    then a Gumbel-max style draw: argmax(p / E) with E ~ Exp(1) is a draw from p.
    """
    logits = logits.float()
    if bitmask is not None:
        apply_bitmask_torch(logits, bitmask)
    greedy_tokens = logits.argmax(dim=-1)
    if all_greedy:
        return greedy_tokens
    temp = temperature.float().clamp_min(1e-6)[:, None]
    probs = torch.softmax(logits / temp, dim=-1)
    R, V = probs.shape
    need_sort = bool(((top_k > 0) & (top_k < V)).any() or (top_p < 1.0).any())
    if need_sort:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        rank = torch.arange(V, device=probs.device)[None, :]
        k = torch.where(top_k > 0, top_k, V)[:, None]
        drop = rank >= k
        # top-p: keep the smallest prefix whose mass reaches top_p (always keep the first).
        cum = sorted_p.cumsum(dim=-1)
        drop |= (cum - sorted_p) >= top_p.float()[:, None]
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, idx, sorted_p)
    if (min_p > 0).any():
        thresh = probs.max(dim=-1, keepdim=True).values * min_p.float()[:, None]
        probs = probs.masked_fill(probs < thresh, 0.0)
    noise = _exponential_noise(seeds.tolist(), V, probs.device)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(temperature == 0, greedy_tokens, sampled)
