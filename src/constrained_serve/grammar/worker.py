"""Grammar engines in worker processes, where a runaway can be killed.

Neither grammar engine can be interrupted: llguidance 1.9 spins for ever on some grammars
(holding the GIL in ``compute_ff_tokens``, growing ~10 MB/s in ``compute_mask``), xgrammar's
jump-forward search can too. A thread cannot be stopped, so every call into them runs in a
worker process (``worker_process.py``, forked from a server that imported its backend once:
``fork_server.py``, ``forked_workers.py``) that the engine kills when an item of work overruns its deadline, and
starts afresh. The memory of a killed worker comes back to the system at once; nothing it
did can hang or poison the engine's process.

Protocol, over a Unix socket pair (``multiprocessing.connection.Connection`` framing):
``("init", backend, TokenizerData, options, rows)`` -> ``("ready", pid)``, then
``(seq, items)`` -> ``(results, log records)`` for ever (items and results: ``host.py``). Before
each item the worker stamps ``(seq, item index, start time)`` into a small shared page, so
``collect_all`` can tell which item overran and by how much. Mask workers also map
the engine's bitmask (``SharedBitmask``) and write mask rows straight into it.

What it costs (``benchmarks/masks.py``): one round trip per batch of items, about
100-200 us on the 2-core CI machine, instead of a function call.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from . import launcher
from .forked_workers import start_worker
from .shared_memory import PAGE, ProgressCell, SharedBitmask, shared_file

logger = logging.getLogger(__name__)

__all__ = ["ProgressCell", "SharedBitmask", "WorkerClient", "WorkerFailure", "batch_time_left", "collect_all"]

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# An item that blocks without spinning (no CPU time) is still cut: at this many times its
# deadline, plus this many seconds, of wall time.
WALL_FACTOR, WALL_SLACK_S = 3.0, 5.0


class WorkerFailure(Exception):
    """A worker overran an item's deadline (``overrun``), died, or could not start.
    ``index`` is the item it was running (-1: none, or unknown)."""

    def __init__(
        self, message: str, index: int = -1, overrun: bool = False, elapsed: tuple[float, float | None] | None = None
    ):
        super().__init__(message)
        self.index = index
        self.overrun = overrun
        self.elapsed = elapsed  # (wall, CPU seconds) the overrunning item ran, when known


class WorkerClient:
    """The engine's side of one worker process: start, send a batch, collect it under
    per-item deadlines, kill. Not thread-safe: one caller at a time (the manager's lock)."""

    def __init__(
        self,
        backend: str,
        tokenizer: Any,
        options: dict[str, Any] | None = None,
        bitmask: SharedBitmask | None = None,
        label: str = "",
        start_timeout_s: float = 120.0,
        reply_timeout_s: float = 30.0,
    ):
        self.backend = backend
        self.label = label or backend
        self._tokenizer = tokenizer  # TokenizerData
        self._options = dict(options or {})
        self.bitmask = bitmask
        self.start_timeout_s = start_timeout_s
        self.reply_timeout_s = reply_timeout_s  # for the reply itself, once the last item is done
        self.epoch = 0  # +1 per start: matchers created in an older epoch are gone
        self.starts = 0
        self.kills = 0
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._progress_fd, page = shared_file(PAGE, "cs-progress")
        self._progress = ProgressCell(page)
        self._seq = 0
        self._sent: tuple[int, list[float], float] | None = None  # seq, deadlines, send time
        self._last_elapsed: tuple[float, float | None] = (0.0, None)  # wall, CPU of the item running
        self._start_lock = threading.Lock()  # a warm-up thread may be starting it

    # -- life ----------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def busy(self) -> bool:
        return self._sent is not None

    def start(self) -> None:
        """Start the process (if not running) and wait until its backend is built."""
        with self._start_lock:
            if not self.alive:
                self._start()

    def _start(self) -> None:
        self.kill()
        ours, theirs = socket.socketpair()
        fds = [theirs.fileno(), self._progress_fd] + ([self.bitmask.fd] if self.bitmask else [])
        try:
            self._proc = start_worker(self.backend, fds)
        finally:
            theirs.close()
        launcher.start_stderr_thread(self._proc.stderr, f"{self.label} grammar worker", self._proc.pid)
        self._conn = Connection(ours.detach())
        self.epoch += 1
        self.starts += 1
        self._progress.write(-1, -1, 0.0, 0.0)  # the old worker is dead: this page has no other writer
        rows = (self.bitmask.rows, self.bitmask.width) if self.bitmask else None
        try:
            self._conn.send(("init", self.backend, self._tokenizer, self._options, rows))
            reply = self._recv_within(self.start_timeout_s, "start")
        except BaseException:
            self.kill()
            raise
        if reply[0] != "ready":
            self.kill()
            raise WorkerFailure(f"the {self.label} grammar worker could not start:\n{reply[1]}")
        logger.debug("%s grammar worker started (pid %d)", self.label, self._proc.pid)

    def _recv_within(self, timeout_s: float, what: str) -> Any:
        end = time.monotonic() + timeout_s
        while not self._conn.poll(0.05):
            if not self.alive:
                raise WorkerFailure(
                    f"the {self.label} grammar worker exited during {what} (exit code {self._proc.returncode})"
                )
            if time.monotonic() > end:
                raise WorkerFailure(f"the {self.label} grammar worker did not answer within {timeout_s:g} s ({what})")
        return self._conn.recv()

    def kill(self) -> None:
        """SIGKILL the process (its memory comes back at once). The next ``start`` is a new epoch."""
        self._sent = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
                self.kills += 1
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                logger.error("%s grammar worker (pid %d) survived SIGKILL for 10 s", self.label, self._proc.pid)
            self._proc = None

    def close(self) -> None:
        self.kill()
        fd, self._progress_fd = self._progress_fd, -1
        if fd >= 0:
            os.close(fd)

    # -- work ----------------------------------------------------------------------------
    def submit(self, items: list[tuple], deadlines: Sequence[float]) -> None:
        """Send a batch; ``deadlines[i]``: seconds item i may take once it starts."""
        assert self._sent is None, "collect the previous batch first"
        self.start()
        self._seq += 1
        try:
            self._conn.send((self._seq, items))
        except OSError as e:  # the worker died since the last batch
            self.kill()
            raise WorkerFailure(f"the {self.label} grammar worker is gone ({e})") from e
        self._sent = (self._seq, list(deadlines), time.monotonic())

    def call(self, items: list[tuple], deadlines: Sequence[float]) -> list[tuple[bool, Any]]:
        """Send and collect one batch; raises WorkerFailure if the worker overran or died."""
        self.submit(items, deadlines)
        [out] = collect_all([self])
        if isinstance(out, WorkerFailure):
            raise out
        return out

    def _cpu_seconds(self) -> float | None:
        """The worker's CPU time so far (Linux: /proc), None where unknown."""
        try:
            with open(f"/proc/{self._proc.pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime + stime
        except (OSError, IndexError, ValueError, AttributeError):
            return None

    # -- collecting (collect_all) --------------------------------------------------------
    @property
    def connection(self) -> Connection | None:
        """What ``multiprocessing.connection.wait`` waits on for the reply (None: not running)."""
        return self._conn

    def has_reply(self) -> bool:
        """A reply (or the end of the connection) is there to read now."""
        return self._conn is not None and self._conn.poll(0)

    def time_left(self, now: float) -> tuple[float, int]:
        """Seconds before the batch in flight overruns, and the item that would overrun
        (``batch_time_left``)."""
        left, index, elapsed = batch_time_left(
            now, self._sent, self._progress.read(), self._cpu_seconds, self.reply_timeout_s
        )
        if elapsed is not None:
            self._last_elapsed = elapsed
        return left, index

    def receive(self) -> list[tuple[bool, Any]]:
        """The batch's results (their reply is ready); WorkerFailure if the worker died."""
        try:
            results, records = self._conn.recv()
        except (EOFError, OSError) as e:
            index = self._progress.read()[1]
            self.kill()
            raise WorkerFailure(f"the {self.label} grammar worker died ({e})", index=index) from e
        self._sent = None
        for r in records:  # the worker's log records, through this process's logging
            logging.getLogger(r[0]).log(r[1], "grammar worker: %s", r[2])
        return results

    def overrun(self, index: int) -> WorkerFailure:
        """Kill the worker, whose item ``index`` overran its deadline; the failure that says so."""
        seq, deadlines, _ = self._sent
        limit = deadlines[index] if 0 <= index < len(deadlines) else self.reply_timeout_s
        self.kill()
        wall, cpu = self._last_elapsed
        ran = f"{wall:.1f} s wall" + ("" if cpu is None else f", {cpu:.1f} s CPU")
        return WorkerFailure(
            f"the {self.label} grammar worker overran its deadline of {limit:g} s of CPU time "
            f"(item {index}, after {ran}); killed",
            index=index,
            overrun=True,
            elapsed=(wall, cpu),
        )


def batch_time_left(
    now: float,
    sent: tuple[int, Sequence[float], float],
    progress: tuple[int, int, float, float],
    cpu_seconds: Callable[[], float | None],
    reply_timeout_s: float,
) -> tuple[float, int, tuple[float, float | None] | None]:
    """Seconds before a batch overruns, the item that would overrun, and (wall, CPU seconds)
    that item ran (None where no item is running). ``sent``: (seq, deadlines, send time) of
    the batch; ``progress``: the worker's page (seq, item index, its start wall and CPU time);
    ``cpu_seconds()``: the worker's CPU time now, None where unknown.

    An item has run for the smaller of its wall time and the worker's CPU time since it
    started (where /proc tells): a busy machine, or a paused VM, does not kill work that
    merely waited for a core (its CPU time stands still), and a backend that compiles on
    several threads is not killed for using two cores at once (its wall time is the
    smaller). A runaway spins, so both grow. Wall time alone still bounds an item that
    blocks without spinning: WALL_FACTOR times its deadline, plus WALL_SLACK_S."""
    seq, deadlines, sent_at = sent
    got_seq, index, started, cpu_started = progress
    if got_seq != seq or index < 0:  # still reading the batch: look again soon, to see item 0 start
        return min(sent_at + reply_timeout_s - now, 0.005), -1, None
    if index >= len(deadlines):  # all done, the reply is on its way
        return started + reply_timeout_s - now, -1, None
    limit = deadlines[index]
    wall = now - started
    cap_left = WALL_FACTOR * limit + WALL_SLACK_S - wall
    cpu = cpu_seconds()
    elapsed = (wall, None if cpu is None else cpu - cpu_started)
    if cpu is None:
        return limit - wall, index, elapsed
    # /proc counts in ticks (10 ms): a tick of slack so an item is not cut a tick early
    cpu_left = limit - (cpu - cpu_started) + 1.0 / _CLOCK_TICKS
    return min(max(cpu_left, limit - wall), cap_left), index, elapsed


def collect_all(clients: Sequence[WorkerClient]) -> list[list[tuple[bool, Any]] | WorkerFailure]:
    """Wait for the batches sent to ``clients``, each under its own per-item deadlines. A
    worker that overruns or dies is killed and gets a ``WorkerFailure`` in its place; any
    other exception (Ctrl-C) kills every worker still busy, whose state is then unknown."""
    out: dict[int, Any] = {i: c.take() for i, c in enumerate(clients) if getattr(c, "inline", False)}
    try:
        while len(out) < len(clients):
            now = time.monotonic()
            waiting: list = []
            timeout = 0.25
            for i, c in enumerate(clients):
                if i in out:
                    continue
                left, index = c.time_left(now)
                if left <= 0:
                    out[i] = c.overrun(index)
                    continue
                if not c.alive and not c.has_reply():
                    c.kill()
                    out[i] = WorkerFailure(f"the {c.label} grammar worker died (item {index})", index=index)
                    continue
                waiting.append(c.connection)
                timeout = min(timeout, left)
            if not waiting:
                break
            ready = wait(waiting, timeout=max(timeout, 0.0))
            for i, c in enumerate(clients):
                if i not in out and c.connection is not None and c.connection in ready:
                    try:
                        out[i] = c.receive()
                    except WorkerFailure as e:
                        out[i] = e
    except BaseException:
        for i, c in enumerate(clients):
            if i not in out and c.busy:
                c.kill()
        raise
    return [out[i] for i in range(len(clients))]
