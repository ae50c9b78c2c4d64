"""The replicas' work under way, for the driver's progress line (``--ray`` on a terminal).

A replica decodes a whole batch before its rows come back, so a line fed by rows alone sits
still while the replicas work. Each replica therefore publishes what its engine is doing
(rows in flight, the tokens generated for them so far) to a small actor the driver creates
for the job, and the driver's progress line reads the sum::

    replica (ActivityReporter: a daemon thread, every 0.5 s while a batch runs)
        --board.report.remote(replica, batch, rows, tokens)-->  ProgressBoard (an actor, 0 CPUs)
    driver (BoardActivity, the progress line's activity())
        --ray.get(board.entries.remote(), timeout)-->  the sum over batches not delivered yet

A replica's rows in flight are its batch's rows not yet returned: those its engine still
decodes and those finished but held until the batch is done (their tokens count too). It
clears its entry when the batch ends: the progress line then counts those rows' tokens from
the rows themselves (``usage``). So that no row counts twice, whatever the order in which
the clear and the rows arrive (and however old the driver's last read of the board), an
entry names its batch (replica, start time: the rows' ``replica`` and ``started`` columns),
and the driver leaves out every batch it has had a row of (``BoardActivity.delivered``).

Cost: a report is a fire-and-forget actor call (no ``ray.get`` in the replica); the board
is created only when a progress line shows it, and killed when the job ends. It is not
detached, so a driver that dies takes it along.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger(__name__)

REPORT_EVERY_S = 0.5  # how often a replica reports while a batch runs
# An entry not refreshed for this long is dropped: its replica died mid-batch (Ray retries
# the batch elsewhere, or in the restarted actor, which reports afresh).
STALE_S = 10.0
TOTALS_TIMEOUT_S = 0.25  # how long the driver's progress thread waits for the board
MIN_FETCH_INTERVAL_S = 0.2  # the driver asks at most this often (rows written draw the line too)

Activity = tuple[int, int]  # (rows in flight, tokens generated for them)
Entry = tuple[str, float, int, int]  # (replica, batch: its start time, rows in flight, tokens)


class ProgressBoard:
    """Each replica's latest report, on the batch it runs. Runs as a Ray actor
    (``create_board``); plain Python otherwise."""

    def __init__(self, stale_s: float = STALE_S, clock: Callable[[], float] = time.monotonic):
        self._stale_s = stale_s
        self._clock = clock
        self._entries: dict[str, tuple[float, int, int, float]] = {}  # replica -> (batch, rows, tokens, when)

    def report(self, replica: str, batch: float, in_flight: int, tokens: int) -> None:
        """``replica``'s batch ``batch`` has ``in_flight`` rows under way holding ``tokens``
        tokens; (0, 0): none (the batch ended)."""
        if in_flight <= 0 and tokens <= 0:
            self._entries.pop(replica, None)
        else:
            self._entries[replica] = (batch, max(in_flight, 0), max(tokens, 0), self._clock())

    def entries(self) -> list[Entry]:
        """The replicas that reported lately, each with its batch's rows in flight and tokens."""
        now = self._clock()
        for replica in [r for r, e in self._entries.items() if now - e[3] > self._stale_s]:
            del self._entries[replica]
        return [(replica, batch, rows, tokens) for replica, (batch, rows, tokens, _) in self._entries.items()]


def totals(entries: list[Entry], delivered: set[tuple[str, float]] | frozenset = frozenset()) -> Activity:
    """(rows in flight, their tokens) of ``entries``, less the batches in ``delivered``
    (their rows reached the driver, which counts them as rows)."""
    live = [e for e in entries if (e[0], e[1]) not in delivered]
    return sum(e[2] for e in live), sum(e[3] for e in live)


def create_board(ray: Any) -> Any:
    """A ProgressBoard actor for one job: no CPU reserved (CPU replicas hold every core), on
    the driver's node where it can be, owned by the driver (not detached)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=True)
    return ray.remote(ProgressBoard).options(num_cpus=0, max_restarts=0, scheduling_strategy=here).remote()


@contextlib.contextmanager
def job_board(ray: Any, activity: BoardActivity | None) -> Iterator[Any]:
    """A job's board, read by ``activity`` (None, and no actor, without one). When the job
    ends (done, failed, Ctrl-C) ``activity`` lets go of it and the actor is killed, before
    the job's Ray session closes."""
    if activity is None:
        yield None
        return
    board = create_board(ray)
    activity.attach(board)
    try:
        yield board
    finally:
        activity.detach()
        try:
            ray.kill(board, no_restart=True)
        except Exception as e:  # noqa: BLE001 - gone already; never fail (or hide) the job's end for it
            logger.debug("progress board: kill failed: %s: %s", type(e).__name__, e)


class ActivityReporter:
    """In a replica, while a batch runs: ``activity()`` sent to the board every ``every_s``
    from a daemon thread; the entry cleared when the batch ends (``with`` block)."""

    def __init__(
        self,
        board: Any,
        replica: str,
        batch: float,
        activity: Callable[[], Activity],
        every_s: float = REPORT_EVERY_S,
    ):
        self._board, self._replica, self._batch = board, replica, batch
        self._activity, self._every_s = activity, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"progress-{replica}", daemon=True)

    def __enter__(self) -> ActivityReporter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        # After the thread's last report (an actor runs one caller's calls in order), so the
        # entry stays cleared: the batch's rows are on their way to the driver.
        self._send(0, 0)

    def _loop(self) -> None:
        while not self._stop.wait(self._every_s):
            try:
                in_flight, tokens = self._activity()
            except Exception as e:  # noqa: BLE001 - a display's input: skip this report
                logger.debug("replica %s: activity failed: %s: %s", self._replica, type(e).__name__, e)
                continue
            self._send(in_flight, tokens)

    def _send(self, in_flight: int, tokens: int) -> None:
        try:
            self._board.report.remote(self._replica, self._batch, in_flight, tokens)  # fire and forget
        except Exception as e:  # noqa: BLE001 - the board is gone (the job ends): nothing to show
            logger.debug("replica %s: progress report failed: %s: %s", self._replica, type(e).__name__, e)


class BoardActivity:
    """The driver's ``activity()`` for the progress line of a Ray job: the board's entries,
    less the batches the driver has had rows of.

    Unattached (before the job's board exists, after it is gone) it returns ``(0, 0)``. It
    never raises and never waits long: a read that times out is picked up by a later call,
    and the last entries read are used meanwhile. Called from the progress line's thread
    (and from the job's, as rows are drawn); ``attach``, ``detach`` and ``delivered`` from
    the job's.
    """

    def __init__(self, timeout_s: float = TOTALS_TIMEOUT_S, min_interval_s: float = MIN_FETCH_INTERVAL_S):
        self._timeout_s, self._min_interval_s = timeout_s, min_interval_s
        self._lock = threading.Lock()  # the board and what was read from it
        self._board: Any = None
        self._pending: Any = None  # an entries() call not answered yet
        self._fetched = float("-inf")
        self._entries: list[Entry] = []
        self._delivered_lock = threading.Lock()  # not held during a read: delivered() never waits on Ray
        self._delivered: set[tuple[str, float]] = set()

    def attach(self, board: Any) -> None:
        with self._lock:
            self._board, self._pending, self._entries = board, None, []

    def detach(self) -> None:
        """The job ended (rows written, or stopped): nothing is in flight any more."""
        with self._lock:
            self._board, self._pending, self._entries = None, None, []

    def delivered(self, replica: str, batch: float) -> None:
        """A row of ``replica``'s batch ``batch`` (its ``started``) reached the driver: the
        batch's rows count as rows from now on, not as rows in flight."""
        with self._delivered_lock:
            self._delivered.add((replica, batch))

    def __call__(self) -> Activity:
        with self._lock:
            self._read()
            entries = self._entries
        with self._delivered_lock:
            return totals(entries, self._delivered)

    def _read(self) -> None:  # under self._lock
        if self._board is None:
            return
        if self._pending is None and time.monotonic() - self._fetched < self._min_interval_s:
            return
        import ray
        from ray.exceptions import GetTimeoutError

        try:
            if self._pending is None:
                self._pending = self._board.entries.remote()
            entries = ray.get(self._pending, timeout=self._timeout_s)
        except GetTimeoutError:  # a busy node: a later call picks the answer up
            return
        except Exception as e:  # noqa: BLE001 - a dead board, a session gone: keep the last entries
            logger.debug("progress board: read failed: %s: %s", type(e).__name__, e)
            self._pending, self._fetched = None, time.monotonic()
            return
        self._pending, self._fetched = None, time.monotonic()
        self._entries = [(str(r), float(b), int(n), int(t)) for r, b, n, t in entries]
