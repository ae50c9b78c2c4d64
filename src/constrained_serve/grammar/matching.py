"""Requests' matchers, as ``GrammarManager`` (manager.py) makes and advances them: a new
matcher is placed on one of its backend's mask workers (``WorkerPool.place_matcher``) and
made there on first use; advances go out as batches (``batch.py``), after the prefill in
flight is collected (a worker takes one batch at a time). ``MatcherService`` is also the
``MatcherOwner`` of the handles it makes: their one-off calls come back here.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import GrammarError
from .base import CompiledGrammar
from .batch import BatchContext, Entry, MatcherBatch
from .masks import MaskService
from .matchers import Advance, MatcherHandle
from .pool import WorkerPool

__all__ = ["MASK_TIMEOUTS_S", "MatcherService", "PendingAdvance"]

# Default deadline of one request's grammar work in a step, per backend. llguidance fills a
# mask in microseconds (p99 0.13 ms, max 1.3 ms over JSONSchemaBench on the 2-core CI box);
# xgrammar builds each parser state's mask lazily, the first time it is met: p99 100 ms,
# and up to 1.3 s for the largest schemas there (benchmarks/masks.py).
MASK_TIMEOUTS_S = {"llguidance": 0.5, "xgrammar": 3.0}


class PendingAdvance:
    """Grammar advances being run by the workers (``GrammarManager.advance_async``): the
    caller does other work meanwhile, then calls ``result()`` once."""

    def __init__(self, batch: MatcherBatch, finish: Callable[[], list]):
        self._batch: MatcherBatch | None = batch
        self._finish = finish

    def result(self) -> list:
        if self._batch is not None:
            batch, self._batch = self._batch, None
            batch.finish()
        return self._finish()


class MatcherService:
    """Making, releasing and advancing matchers (the step loop's thread, but ``release``)."""

    def __init__(
        self, workers: WorkerPool, batches: BatchContext, masks: MaskService, mask_timeout_s: float | None = None
    ):
        self._workers = workers
        self._batches = batches
        self._masks = masks
        self._mask_timeout_s = mask_timeout_s  # None: each backend's own (MASK_TIMEOUTS_S)

    def new_matcher(self, compiled: CompiledGrammar, mask_timeout_s: float | None = None) -> MatcherHandle:
        """A matcher at the grammar's start (made in its worker on first use)."""
        live = self._workers.place_matcher(compiled.backend, compiled.gid)
        deadline = mask_timeout_s or self._mask_timeout_s or MASK_TIMEOUTS_S[compiled.backend]
        h = MatcherHandle(self, compiled, live, float(deadline))
        weakref.finalize(h, self._workers.release, live)
        return h

    def release(self, h: MatcherHandle) -> None:
        """The request is done with its matcher (thread-safe; the worker drops it later)."""
        self._workers.release(h.live)

    def submit(self, entries: list[Entry]) -> MatcherBatch:
        """Send ``entries`` (after the prefill in flight is collected), without waiting."""
        self._masks.settle_prefill()
        for e in entries:  # the operation changes (or may change) the matcher's state
            e.handle.prefilled = None
        return self._batches.start(entries)

    def run_one(self, h: MatcherHandle, item: tuple) -> Any:
        """One operation on one matcher, and its state after it: one round trip."""
        e, s = [Entry(h, item, h.mask_timeout_s), Entry(h, ("state",), h.mask_timeout_s)]
        self.submit([e, s]).finish()
        if not e.ok:
            raise GrammarError(f"{h.backend_name}: {e.value}", backend=h.backend_name, reason=e.value)
        if item[0] == "accept" and e.value:
            h.history.extend(item[1])
        elif item[0] == "rollback" and item[1] > 0:
            del h.history[len(h.history) - item[1] :]
        if s.ok:
            h.finished, h.can_end_now, _ = s.value
        return e.value

    def fill_bitmask(self, rows_and_handles: Sequence[tuple[int, MatcherHandle]], bitmask: Any) -> list:
        return self._masks.fill_bitmask(rows_and_handles, bitmask)

    def advance_async(self, items: Sequence[tuple[MatcherHandle, Sequence[int], int, Sequence[int]]]) -> PendingAdvance:
        """``GrammarManager.advance`` sent to the workers without waiting: ``result()`` collects it."""
        entries = [
            Entry(h, ("advance", list(toks), int(room), tuple(stop)), h.mask_timeout_s) for h, toks, room, stop in items
        ]
        return PendingAdvance(self.submit(entries), lambda: self._finish_advance(entries))

    def _finish_advance(self, entries: list[Entry]) -> list[Advance | None]:
        out: list[Advance | None] = []
        for en in entries:
            h = en.handle
            if not en.ok:
                out.append(None)
                continue
            a = Advance._make(en.value)
            if a.accepted:
                h.history.extend(en.item[1])
                h.history.extend(a.forced)
                h.finished, h.can_end_now = a.finished, a.can_end
            if a.error is not None:
                self._batches.fail(h, a.error)
                out.append(None)
                continue
            out.append(a)
        return out
