"""Linear layers through oneDNN with weights prepacked once, for fp32 on CPU.

PyTorch's fp32 ``F.linear`` on CPU calls MKL's sgemm, which takes a narrower code path on
AMD CPUs than the hardware offers. oneDNN, bundled with torch, uses AVX-512 wherever the
CPU has it, and a weight prepacked into its blocked layout saves a reorder on every call.
On the project's 2-core AMD EPYC this doubles the GFLOPS of the model's projections at both
64 and 512 rows (141-159 -> 263-318 GFLOPS at 512 rows). The arithmetic stays IEEE fp32;
only the summation order differs. bf16 and fp16 already go through oneDNN, so only fp32 is
packed. ``CONSTRAINED_SERVE_CPU_LINEAR=torch`` turns this off.
"""
from __future__ import annotations

import logging
import os

import torch
from torch import nn

logger = logging.getLogger(__name__)


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with W held in oneDNN's layout (inference only, x: [rows, in])."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # Plain attributes, not buffers: oneDNN tensors have no storage to save or move.
        self.packed_weight = weight.detach().contiguous().to_mkldnn()
        self.packed_bias = None if bias is None else bias.detach().contiguous().to_mkldnn()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._C._nn.mkldnn_linear(x.contiguous().to_mkldnn(), self.packed_weight, self.packed_bias)
        return y.to_dense()

    @property
    def weight(self) -> torch.Tensor:
        """A dense copy of W (for inspection; the forward never uses it)."""
        return self.packed_weight.to_dense()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN prepacked"


def should_pack(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or dtype != torch.float32:
        return False
    if os.environ.get("CONSTRAINED_SERVE_CPU_LINEAR", "onednn") == "torch":
        return False
    return torch.backends.mkldnn.is_available()


def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear in ``model`` by a PackedLinear; returns how many."""
    n = 0
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, PackedLinear(child.weight, child.bias))
            n += 1
        else:
            n += pack_linears(child)
    return n
