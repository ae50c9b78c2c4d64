"""oneDNN matmuls on CPU through the op TorchInductor emits for CPU linears
(``torch.ops.mkldnn._linear_pointwise``), shared by the prepacked projections
(models/cpu_linear.py) and the per-head prefill attention (long_chunks.py).

fp32 ``torch.matmul``/``bmm`` on CPU go to MKL, which takes a narrower code path on AMD CPUs;
oneDNN uses AVX-512 wherever the CPU has it. ``CONSTRAINED_SERVE_CPU_LINEAR=torch`` turns
every use off (plain torch ops instead).
"""

from __future__ import annotations

import os

import torch

_AVAILABLE = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def enabled() -> bool:
    """oneDNN's linear op exists in this torch and the user has not turned it off."""
    return _AVAILABLE and os.environ.get("CONSTRAINED_SERVE_CPU_LINEAR", "onednn") != "torch"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``; weight dense (any strides) or prepacked by
    ``torch.ops.mkldnn._reorder_linear_weight``."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
