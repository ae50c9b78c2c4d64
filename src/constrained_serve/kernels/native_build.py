"""Building and loading the native CPU kernels (the C files in this folder).

Each is compiled on first use with the system C compiler into a cache folder (a few seconds,
once per machine) and loaded with ctypes: no Python extension, no torch headers. Where one
cannot be built (no compiler, not Linux) or is switched off by its environment variable, its
callers take their torch path; the reason is logged once.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "constrained_serve" / "native"


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def cpu_identity() -> str:
    """The CPU's model and instruction-set flags: with -march=native, a library built on one
    CPU may not run on another (a home folder shared between machines), so they key the cache."""
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(line for line in f if line.startswith(("model name", "flags")))[:8192]
    except OSError:
        return ""


def build(cc: str, source: Path, cflags: list[str]) -> Path:
    """The shared object for this source, compiler, flags and CPU: built once (the file name
    is their hash), written to a temporary name first so concurrent builds cannot clash."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    stamp = " ".join([cc, *cflags, version, cpu_identity()])
    key = hashlib.sha256(source.read_bytes() + stamp.encode()).hexdigest()[:16]
    out = cache_dir() / f"{source.stem}_{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        proc = subprocess.run(
            [cc, *cflags, str(source), "-o", str(tmp_out), "-lm"], capture_output=True, text=True, timeout=120
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
        os.replace(tmp_out, out)
    return out


class NativeLibrary:
    """One C file's shared object, built and loaded on the first ``get()``.

    ``declare`` sets the ctypes signatures of the functions the callers use; ``switch`` is the
    environment variable that turns the library off ("0"); ``what`` names it in log lines."""

    def __init__(
        self, source: Path, cflags: list[str], switch: str, what: str, declare: Callable[[ctypes.CDLL], None]
    ) -> None:
        self.source, self.cflags, self.switch, self.what, self.declare = source, cflags, switch, what, declare
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._tried = False

    def reset(self) -> None:
        """Forget the loaded library: the next ``get()`` decides again (tests)."""
        with self._lock:
            self._lib, self._tried = None, False

    def get(self) -> ctypes.CDLL | None:
        """The loaded library; None where it is switched off or cannot be built."""
        if self._tried:
            return self._lib
        with self._lock:
            if self._tried:
                return self._lib
            try:
                if os.environ.get(self.switch, "1") == "0":
                    logger.info("native %s off (%s=0): torch path", self.what, self.switch)
                elif not sys.platform.startswith("linux"):
                    logger.info("native %s is built on Linux only: torch path", self.what)
                elif (cc := compiler()) is None:
                    logger.warning("no C compiler (cc, gcc or clang): %s takes the slower torch path", self.what)
                else:
                    lib = ctypes.CDLL(str(build(cc, self.source, self.cflags)))
                    self.declare(lib)
                    self._lib = lib
            except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
                logger.warning("building the native %s failed, the torch path runs instead: %s", self.what, e)
            self._tried = True
            return self._lib
