"""Turns a step's logits into tokens: per-row parameters -> tensors -> one dispatch call.

The grammar bitmask is applied inside the sampling kernel, before temperature and
top-k/top-p/min-p. Seeds are mixed with the token position, so a seeded request draws the
same tokens whatever else shares the batch.
"""
from __future__ import annotations

import torch

from .kernels import dispatch
from .request import Request

_MASK64 = (1 << 63) - 1


def step_seed(seed: int, position: int) -> int:
    # splitmix64-style mixing: nearby (seed, position) pairs give unrelated streams.
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & ((1 << 64) - 1)
    z ^= z >> 31
    z = (z * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 29)) & _MASK64


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, requests: list[Request], bitmask: torch.Tensor | None) -> list[int]:
        ps = [r.params for r in requests]
        all_greedy = all(p.temperature == 0.0 for p in ps)
        dev = self.device
        if bitmask is not None:
            bitmask = bitmask.to(dev, non_blocking=True)
        if all_greedy:
            z = torch.zeros(len(ps), device=dev)
            zi = torch.zeros(len(ps), dtype=torch.int32, device=dev)
            tokens = dispatch.sample(logits, bitmask, z, zi, z + 1, z, zi.long(), all_greedy=True)
            return tokens.tolist()
        temperature = torch.tensor([p.temperature for p in ps], dtype=torch.float32)
        top_k = torch.tensor([p.top_k for p in ps], dtype=torch.int32)
        top_p = torch.tensor([p.top_p for p in ps], dtype=torch.float32)
        min_p = torch.tensor([p.min_p for p in ps], dtype=torch.float32)
        seeds = torch.tensor([step_seed(r.seed, r.num_tokens) for r in requests], dtype=torch.int64)
        tokens = dispatch.sample(logits, bitmask, temperature.to(dev), top_k.to(dev), top_p.to(dev),
                                 min_p.to(dev), seeds.to(dev))
        return tokens.tolist()
