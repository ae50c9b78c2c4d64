"""Starting the grammar processes: from one long-lived thread, in the environment they need.

A grammar worker (or the fork server that forks them, fork_server.py) asks the kernel to
SIGKILL it when its parent dies (PR_SET_PDEATHSIG), which on Linux means the *thread* that
started it: a caller's short-lived thread (a warm-up, a request's compile) would take the
process with it when that thread ends. So every one is started by the same daemon thread,
which lives as long as the engine's process.
"""

from __future__ import annotations

import logging
import os
import queue
import subprocess
import threading
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["forward_stderr", "popen", "start_stderr_thread", "worker_env"]

_lock = threading.Lock()
_queue: "queue.Queue[tuple[list[str], dict[str, Any], queue.Queue]] | None" = None


def popen(argv: list[str], **kw: Any) -> subprocess.Popen:
    """``subprocess.Popen(argv, **kw)``, started by the launcher thread."""
    global _queue
    with _lock:
        if _queue is None:
            _queue = queue.Queue()
            threading.Thread(target=_serve, args=(_queue,), name="grammar-worker-launcher", daemon=True).start()
        q = _queue
    reply: queue.Queue = queue.Queue()
    q.put((argv, kw, reply))
    ok, value = reply.get()
    if not ok:
        raise value
    return value


def _serve(q: queue.Queue) -> None:
    while True:
        argv, kw, reply = q.get()
        try:
            reply.put((True, subprocess.Popen(argv, **kw)))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            reply.put((False, e))


def worker_env() -> dict[str, str]:
    """The environment of a grammar process: this one's, with the package importable as this
    process imports it (a source checkout on sys.path included) and one thread each."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    # The worker's work is sequential, the cores belong to the forward. One thread also keeps
    # OpenBLAS and torch from starting thread pools at import, which the fork server needs.
    env.update(OMP_NUM_THREADS="1", RAYON_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


def forward_stderr(stream: Any, label: str) -> None:
    """What a grammar process prints (xgrammar's C++ warnings, a crash's last words) goes to
    logging rather than to the user's terminal; read by a thread so the pipe never fills."""
    with stream:
        for raw in stream:
            line = raw.decode("utf-8", "replace").rstrip()
            if line:
                logger.debug("%s: %s", label, line)


def start_stderr_thread(stream: Any, label: str, pid: int) -> None:
    threading.Thread(target=forward_stderr, args=(stream, label), daemon=True, name=f"grammar-stderr-{pid}").start()
