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
