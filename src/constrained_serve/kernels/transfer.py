"""Small host tensors onto the device without a wait: the samplers' index and parameter
tensors (kernels/sampling_candidates.py, runtime/sampler.py)."""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device`` without waiting for the work queued there: a copy
    from pageable memory would (the pipelined loop has the next step to prepare meanwhile)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
