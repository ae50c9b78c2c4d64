"""Ray is an optional extra: find it, or say in one line what to install.

Nothing in ``constrained_serve`` imports Ray at import time; the Ray job calls
``require_ray()`` first, so a missing install fails at once, before any file is opened or
any model is loaded.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

INSTALL_HINT = "pip install 'constrained-serve[ray]'"
MIN_VERSION = (2, 60)


class RayNotInstalledError(ImportError):
    """Ray (with Ray Data) is not installed, or is older than the version we were tested on."""


def require_ray() -> ModuleType:
    """The ``ray`` module, with Ray Data installed; RayNotInstalledError otherwise.

    Ray Data is found, not imported (pandas and pyarrow: about a second): a file job runs on
    Ray's actors alone, and ``ray.data`` imports itself on first use (a Dataset job)."""
    try:
        ray = importlib.import_module("ray")
        found = importlib.util.find_spec("ray.data") is not None
    except ImportError as e:
        raise RayNotInstalledError(f"running on Ray needs Ray Data: {INSTALL_HINT} ({e})") from None
    if not found:
        raise RayNotInstalledError(f"running on Ray needs Ray Data: {INSTALL_HINT} (no ray.data)")
    try:
        version = tuple(int(p) for p in ray.__version__.split(".")[:2])
    except ValueError:  # a nightly or local build: trust it
        return ray
    if version < MIN_VERSION:
        raise RayNotInstalledError(
            f"Ray {ray.__version__} is too old (need >= {MIN_VERSION[0]}.{MIN_VERSION[1]}): {INSTALL_HINT}"
        )
    return ray
