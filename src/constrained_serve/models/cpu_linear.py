"""Linear layers through oneDNN with weights prepacked once, for fp32 on CPU.

PyTorch's fp32 ``F.linear`` on CPU calls MKL's sgemm, which takes a narrower code path on
AMD CPUs than the hardware offers. oneDNN, bundled with torch, uses AVX-512 wherever the
CPU has it, and a weight prepacked into its blocked layout saves a reorder on every call.
The call is the one TorchInductor emits for CPU linears (``mkldnn._linear_pointwise`` on a
weight from ``mkldnn._reorder_linear_weight``): dense in, dense out, no layout conversion
of the activations. On the project's 2-core AMD EPYC the model's projections run at
400-440 GFLOPS at 64 and 512 rows, against 92-159 through MKL. The arithmetic stays IEEE
fp32; only the summation order differs. bf16 ``F.linear`` already reaches oneDNN but
without a prepacked weight: packing takes it from 120-215 to 233-423 GFLOPS at 10 rows and
about 1.2x at 64-512 rows, so bf16 is packed too (fp16 is not: without avx512_fp16 oneDNN
emulates it). ``CONSTRAINED_SERVE_CPU_LINEAR=torch`` turns this off.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..kernels import onednn

logger = logging.getLogger(__name__)


# The weight layout is chosen for this many rows; any row count works (64 and up run at
# full speed whatever the hint, measured).
_ROWS_HINT = 128


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with W held in oneDNN's blocked layout (inference only, x: [rows, in])."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # Plain attributes, not buffers: oneDNN tensors have no storage to save or move.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _ROWS_HINT)
        self.bias = None if bias is None else bias.detach().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return onednn.linear(x.contiguous(), self.packed_weight, self.bias)

    @property
    def weight(self) -> torch.Tensor:
        """A dense copy of W (for inspection; the forward never uses it)."""
        return self.packed_weight.to_dense()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN prepacked"


def should_pack(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    return onednn.enabled() and onednn.supports(dtype)


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
