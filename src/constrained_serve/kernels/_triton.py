"""The one guarded import of Triton: the package and its CPU path work without it."""

from __future__ import annotations

try:
    import triton  # noqa: F401
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None
    HAS_TRITON = False


def require_triton() -> None:
    """Raise a clear error where a Triton kernel is called without Triton."""
    if not HAS_TRITON:
        raise RuntimeError(
            "triton is not installed: use the torch reference kernels "
            "(CONSTRAINED_SERVE_KERNELS=torch) or `pip install triton`"
        )
