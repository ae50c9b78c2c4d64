"""A step's per-row sampling parameters, as the samplers read them: one tensor per parameter,
one entry per row, on the logits' device. ``sample_torch`` (sampling.py), ``sample_fused_triton``
(sampling_triton.py) and the top-k candidate path (sampling_candidates.py) all take one.

A NamedTuple, so the candidate path can unpack it and swap filters (``_replace``), and the
Triton launches can pass its fields as the kernels' pointer arguments in order.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class SamplingTensors(NamedTuple):
    temperature: torch.Tensor  # float [R]; 0: greedy (the masked argmax)
    top_k: torch.Tensor  # int [R]; 0 (or >= vocab): off
    top_p: torch.Tensor  # float [R]; 1: off
    min_p: torch.Tensor  # float [R]; 0: off
    seeds: torch.Tensor  # int64 [R]: the row's seed for this step (sampler.step_seed)

    @classmethod
    def full(
        cls,
        rows: int,
        device: torch.device | str = "cpu",
        temperature: float | torch.Tensor = 0.0,
        top_k: int | torch.Tensor = 0,
        top_p: float | torch.Tensor = 1.0,
        min_p: float | torch.Tensor = 0.0,
        seed0: int = 0,
    ) -> "SamplingTensors":
        """``rows`` rows of these values (a tensor gives each row its own), seeds ``seed0``,
        ``seed0 + 1``, ...; greedy by default."""

        def col(v: float | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            if isinstance(v, torch.Tensor):
                return v.to(device, dtype)
            return torch.full((rows,), v, dtype=dtype, device=device)

        return cls(
            col(temperature, torch.float32),
            col(top_k, torch.int32),
            col(top_p, torch.float32),
            col(min_p, torch.float32),
            torch.arange(seed0, seed0 + rows, dtype=torch.int64, device=device),
        )

    def index_select(self, index: torch.Tensor) -> "SamplingTensors":
        """The rows ``index`` picks, in its order."""
        return SamplingTensors(*(t.index_select(0, index) for t in self))
