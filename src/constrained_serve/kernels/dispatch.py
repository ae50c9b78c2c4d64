"""Picks the kernel implementation by device: Triton on CUDA, the torch reference elsewhere.

``CONSTRAINED_SERVE_KERNELS=torch`` forces the references everywhere (``triton`` forces
Triton, which on CPU only works under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import os

import torch

from . import attention, sampling


def use_triton(device: torch.device) -> bool:
    choice = os.environ.get("CONSTRAINED_SERVE_KERNELS", "auto").lower()
    if choice == "torch":
        return False
    if choice == "triton":
        return True
    return device.type == "cuda"


def store_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    return attention.store_kv_torch(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(q, k_cache, v_cache, meta, scale):
    return attention.paged_attention_torch(q, k_cache, v_cache, meta, scale)


def sample(logits, bitmask, temperature, top_k, top_p, min_p, seeds, *, all_greedy=False):
    return sampling.sample_torch(logits, bitmask, temperature, top_k, top_p, min_p, seeds,
                                 all_greedy=all_greedy)
