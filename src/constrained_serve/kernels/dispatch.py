"""Picks the kernel implementation by device: Triton on CUDA, the torch reference elsewhere.

``CONSTRAINED_SERVE_KERNELS=torch`` forces the references everywhere; ``triton`` forces
Triton (which on CPU only works under TRITON_INTERPRET=1); ``auto`` (default) uses Triton
on CUDA when it is installed. The choice is read at each call so tests can flip it.
"""

from __future__ import annotations

import logging
import os

import torch

from . import attention, sampling
from .attention_metadata import AttentionMetadata
from .sampling_tensors import SamplingTensors

logger = logging.getLogger(__name__)

_CHOICES = ("auto", "torch", "triton")
_warned_missing = False


def kernel_choice() -> str:
    choice = os.environ.get("CONSTRAINED_SERVE_KERNELS", "auto").strip().lower() or "auto"
    if choice not in _CHOICES:
        raise ValueError(f"CONSTRAINED_SERVE_KERNELS must be one of {_CHOICES}, got {choice!r}")
    return choice


def use_triton(device: torch.device) -> bool:
    global _warned_missing
    choice = kernel_choice()
    if choice == "torch":
        return False
    if choice == "triton":
        if not attention.HAS_TRITON:
            raise RuntimeError("CONSTRAINED_SERVE_KERNELS=triton but triton is not installed")
        return True
    if device.type != "cuda":
        return False
    if not attention.HAS_TRITON:
        if not _warned_missing:
            logger.warning("triton is not installed: using the torch reference kernels on CUDA")
            _warned_missing = True
        return False
    return True


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    if use_triton(k_cache.device):
        return attention.store_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    return attention.store_kv_torch(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    if use_triton(q.device) and attention.triton_supports(q, k_cache):
        return attention.paged_attention_triton(q, k_cache, v_cache, meta, scale)
    return attention.paged_attention_torch(q, k_cache, v_cache, meta, scale)


def sample(
    logits: torch.Tensor,
    bitmask: torch.Tensor | None,
    params: SamplingTensors,
    *,
    all_greedy: bool = False,
    candidates: tuple[list[int], int] | None = None,
) -> torch.Tensor:
    """``candidates``: (rows, their largest top_k) for the Triton path's top-k candidate
    sampling (sampling_candidates.py); the torch path samples every row the same way."""
    if use_triton(logits.device):
        return sampling.sample_triton(logits, bitmask, params, all_greedy=all_greedy, candidates=candidates)
    return sampling.sample_torch(logits, bitmask, params, all_greedy=all_greedy)
