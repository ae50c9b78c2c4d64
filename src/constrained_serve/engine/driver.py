"""The one object that drives an ``EngineCore`` for its callers: it owns the core lock and the
add / step / abort loop that ``Engine.generate``/``chat``/``generate_iter``, ``Engine.stream``
and ``AsyncEngine``'s stepper thread all go through.

One thread at a time drives the core (adds, steps, aborts) and changes the cache
(conversation pins take the same lock, cache/pins.py). Callers on several threads still share
batches: every step advances every caller's requests, and each caller only waits for its own,
so a step run by another thread may finish the requests a caller waits on (``step_for`` then
runs none). An abort asked for from inside a step (a generator finalised by the garbage
collector during the forward) is deferred to the step's end by ``EngineCore.abort`` itself.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from .request import Request

if TYPE_CHECKING:
    from .core import EngineCore

__all__ = ["Driver", "LostRequestError"]


class LostRequestError(RuntimeError):
    """A request is unfinished but the core no longer schedules it (an engine bug, or an error
    inside a step that lost its state): its caller would wait forever, so it raises instead."""

    def __init__(self, r: Request) -> None:
        super().__init__(
            f"request {r.request_id} is unfinished but no longer scheduled "
            "(engine state lost, e.g. after an error inside a step)"
        )
        self.request = r


class Driver:
    """Adds, steps and aborts requests on one ``EngineCore``, under one re-entrant lock.

    Each method takes the lock itself; hold ``lock`` around several calls (or around reading
    requests' state, e.g. a stream's text) to see them as one step left them."""

    def __init__(self, core: EngineCore, lock: threading.RLock | None = None) -> None:
        self.core = core
        self._lock = lock if lock is not None else threading.RLock()

    @property
    def lock(self) -> threading.RLock:
        """The core lock (re-entrant): held while the core is driven or the cache changed."""
        return self._lock

    def activity(self) -> tuple[int, int]:
        """(unfinished requests, output tokens they hold so far), for a progress display.

        Read without the lock, from any thread (a display refreshing while the main thread
        steps): a snapshot up to a step old. Copying the dict's values is one C call under
        the GIL, so it sees the dict whole; the counts are plain ints."""
        try:
            requests = list(self.core.scheduler.unfinished.values())
        except RuntimeError:  # resized meanwhile (a free-threaded build): the next read gets it
            return 0, 0
        return len(requests), sum(r.num_output for r in requests)

    def add(self, requests: Iterable[Request]) -> None:
        """Queue requests on the core; the next step schedules them."""
        with self._lock:
            for r in requests:
                self.core.add(r)

    def abort(self, requests: Iterable[Request]) -> None:
        """End the unfinished ones among ``requests`` (a caller that stopped early, a client
        that went away) and free their pages; finished ones are left as they are. From inside
        a step the core applies the abort when the step is done."""
        with self._lock:
            for r in requests:
                if not r.finished:
                    self.core.abort(r)
            self.core.drain_finished()

    def step_for(self, requests: Sequence[Request]) -> bool:
        """One step for a caller waiting on ``requests``, unless they have all finished (another
        thread's step may have finished them: then nothing runs). Returns whether the step made
        progress: a step that only waits for grammars to compile runs nothing.

        Raises ``LostRequestError`` when one of them is unfinished yet the core has no work, and
        whatever the step raises (the requests it finished are drained first)."""
        with self._lock:
            waiting = next((r for r in requests if not r.finished), None)
            if waiting is None:
                return False
            core = self.core
            if not core.has_work():
                raise LostRequestError(waiting)
            # A step that only reads the launched step's tokens made progress too.
            before, reading = core.num_steps, core.awaiting_tokens
            try:
                core.step()
            except BaseException:
                core.drain_finished()
                raise
            return reading or core.num_steps != before
