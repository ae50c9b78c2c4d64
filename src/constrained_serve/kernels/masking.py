"""Causal visibility of paged keys, and the masked softmax, shared by the torch attention
paths (short_rows.py, long_chunks.py).

Both paths fold the GQA group's query heads into the query length: a query slot's row
becomes ``group`` consecutive rows, one per head of its group, all seeing the same keys.
"""

from __future__ import annotations

import torch


def visible_keys(qpos: torch.Tensor, num_keys: int, group: int) -> torch.Tensor:
    """qpos [..., n] (positions of query slots) -> bool [..., n * group, num_keys]: the key at
    position k is visible to a slot at position p when k <= p."""
    visible = torch.arange(num_keys, device=qpos.device) <= qpos[..., None]  # [..., n, keys]
    *lead, n, _ = visible.shape
    return visible.unsqueeze(-2).expand(*lead, n, group, num_keys).reshape(*lead, n * group, num_keys)


def additive_mask(visible: torch.Tensor) -> torch.Tensor:
    """fp32 bias: 0 where visible, -inf elsewhere (added to the scores before the softmax)."""
    return torch.zeros(visible.shape, device=visible.device).masked_fill_(~visible, float("-inf"))


def masked_softmax(scores: torch.Tensor, scale: float, bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """softmax(scores * scale + bias) in fp32, cast to dtype. bf16/fp16 scores are upcast first,
    as HF's eager attention and SDPA's kernels do. Overwrites fp32 scores in place."""
    return scores.float().mul_(scale).add_(bias).softmax(-1).to(dtype)
