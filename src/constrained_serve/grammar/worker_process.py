"""The grammar worker process (``python -m constrained_serve.grammar.worker_process``):
started by ``worker.WorkerClient``, it loads one backend, then runs the items of each batch
it is sent (``host.MatcherHost``), stamping its progress page before each, until the engine
closes the connection or kills it.
"""

from __future__ import annotations

import signal

# Ctrl-C in a terminal reaches every process of its foreground group, this one too. The
# engine decides what a Ctrl-C means (it stops, then closes or kills its workers); a worker
# that died of it instead made the engine restart it, or report "grammar worker died
# (Connection reset by peer)", while the user only asked to stop. Set before the imports
# below, so the window in which a press still kills the worker is the interpreter's start.
# Only as the worker's own process (``python -m``): a process that imports this module (the
# engine's, a test's) keeps its Ctrl-C.
if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)

import logging  # noqa: E402
import mmap  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from multiprocessing.connection import Connection  # noqa: E402

import numpy as np  # noqa: E402

from .shared_memory import PAGE, ProgressCell  # noqa: E402

# The CPU time stamped before an item is read again only after this long: the engine's clock
# (/proc) ticks every 10 ms and allows a tick of slack, so a reading up to 1 ms old changes no
# deadline, and the syscall would cost more than most items (a few us each, 256 a step).
CPU_REREAD_S = 0.001


class _Records(logging.Handler):
    """Collects the worker's log records; each reply carries them to the engine's logging."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[tuple[str, int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.name, record.levelno, record.getMessage()))

    def take(self) -> list[tuple[str, int, str]]:
        out, self.records = self.records, []
        return out


def exit_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies, however it dies (Linux);
    exit now if ``parent`` is gone already (this process was reparented)."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(1)


def _die_with_parent(parent: int) -> None:
    """``exit_with_parent``, and check by polling elsewhere (a runaway that holds the GIL
    stops only the polling)."""
    exit_with_parent(parent)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str]) -> None:
    parent, sock_fd, progress_fd = int(argv[0]), int(argv[1]), int(argv[2])
    bitmask_fd = int(argv[3]) if len(argv) > 3 else -1
    _die_with_parent(parent)
    records = _Records()
    root = logging.getLogger("constrained_serve")
    root.addHandler(records)
    root.setLevel(logging.INFO)
    root.propagate = False
    conn = Connection(sock_fd)
    progress = ProgressCell(mmap.mmap(progress_fd, PAGE))
    try:
        tag, backend_name, tokenizer, options, rows = conn.recv()
        if tag != "init":
            raise ValueError(f"the grammar worker expected the 'init' message first, got {tag!r}")
        from .host import FaultPlan, MatcherHost, make_backend

        backend = make_backend(backend_name, tokenizer, **options)
        bitmask = None
        if rows is not None:
            bitmask = np.ndarray(rows, dtype=np.int32, buffer=mmap.mmap(bitmask_fd, rows[0] * rows[1] * 4))
        host = MatcherHost(backend, bitmask, FaultPlan.from_env())
    except BaseException:  # noqa: BLE001 - reported to the engine, which raises it
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    cpu_read = [-1.0, 0.0]  # when the CPU time was last read, and its value
    while True:
        try:
            seq, items = conn.recv()
        except (EOFError, OSError):
            return  # the engine closed the connection: done

        def stamp(i: int, seq: int = seq) -> None:
            now = time.monotonic()
            if now - cpu_read[0] > CPU_REREAD_S:
                t = os.times()  # user + system in clock ticks, as the engine reads /proc: one clock
                cpu_read[0], cpu_read[1] = now, t.user + t.system
            progress.write(seq, i, now, cpu_read[1])

        results = host.run(items, stamp)
        stamp(len(items))
        conn.send((results, records.take()))


if __name__ == "__main__":
    main(sys.argv[1:])
