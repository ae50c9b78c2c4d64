"""oneDNN matmuls on CPU through the op TorchInductor emits for CPU linears
(``torch.ops.mkldnn._linear_pointwise``), shared by the prepacked projections
(models/cpu_linear.py) and the per-head prefill attention (long_chunks.py).

fp32 ``torch.matmul``/``bmm`` on CPU go to MKL, which takes a narrower code path on AMD CPUs;
oneDNN uses AVX-512 wherever the CPU has it. ``CONSTRAINED_SERVE_CPU_LINEAR=torch`` turns
every use off (plain torch ops instead).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

logger = logging.getLogger(__name__)

_AVAILABLE = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def enabled() -> bool:
    """oneDNN's linear op exists in this torch and the user has not turned it off."""
    return _AVAILABLE and os.environ.get("CONSTRAINED_SERVE_CPU_LINEAR", "onednn") != "torch"


def supports(dtype: torch.dtype) -> bool:
    """oneDNN runs this dtype's linears on this CPU (``enabled()`` aside). bf16 needs
    avx512bw/vl/dq or avx_ne_convert: on an AVX2-only CPU (the project's AMD EPYC) oneDNN
    refuses to pack a bf16 weight or build a bf16 inner product (a RuntimeError), so callers
    keep torch's ops there. Asked once per dtype, with a tiny matmul."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and _bf16_works())


@functools.cache
def _bf16_works() -> bool:
    if not _AVAILABLE:
        return False
    w = torch.zeros(16, 16, dtype=torch.bfloat16)
    x = torch.zeros(2, 16, dtype=torch.bfloat16)
    try:
        linear(x, w)
        linear(x, torch.ops.mkldnn._reorder_linear_weight(w, 16))
    except RuntimeError as e:
        logger.info("oneDNN cannot run bf16 linears on this CPU: bf16 stays on torch's ops (%s)", e)
        return False
    return True


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``; weight dense (any strides) or prepacked by
    ``torch.ops.mkldnn._reorder_linear_weight``."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
