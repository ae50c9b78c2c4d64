"""The mask side of ``GrammarManager`` (manager.py): the shared bitmask the mask workers
write into (a step's rows, then as many prefill slots), filling a step's rows while the
forward runs, prefilling the next step's rows right after the advance (``prefill_masks``),
failing rows that allow no token, and page-locking the bitmask for CUDA copies.
``MaskService`` holds that state; the bitmask's memory is the ``WorkerPool``'s, which its
mask workers map.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from .base import allocate_bitmask, bitmask_width
from .batch import BatchContext, Entry, MatcherBatch
from .matchers import MatcherHandle
from .pool import WorkerPool
from .shared_memory import SharedBitmask

__all__ = ["MaskService", "PendingMasks"]


class PendingMasks:
    """Mask rows being filled by the workers (``GrammarManager.fill_bitmask_async``).
    ``wait()`` once; ``abandon()`` if the caller cannot wait (it kills the busy workers)."""

    def __init__(
        self,
        masks: "MaskService",
        batch: MatcherBatch | None,
        rows: list[tuple[int, MatcherHandle]],
        dest: Any,
        start: Callable[[], MatcherBatch] | None = None,
    ):
        self._masks, self._batch, self._rows, self._dest = masks, batch, rows, dest
        self._start = start  # deferred: called by wait(), returns the batch

    def wait(self) -> list[MatcherHandle]:
        """Finish the fill; returns the handles that failed (their rows allow every token)."""
        if self._start is not None:
            start, self._start = self._start, None
            self._batch = start()
        if self._batch is None:
            return []
        batch, self._batch = self._batch, None
        batch.finish()  # its workers are killed if it fails to come back
        return self._masks.finish_fill(self._rows, self._dest)

    def abandon(self) -> None:
        self._start = None
        if self._batch is not None:
            self._batch.abandon()
            self._batch = None


class MaskService:
    """Filling and prefilling mask rows in the shared bitmask (the step loop's thread only)."""

    def __init__(self, workers: WorkerPool, batches: BatchContext, vocab_size: int, step_rows: int):
        self._workers = workers
        self._batches = batches
        self.vocab_size = vocab_size
        self.width = bitmask_width(vocab_size)
        # The shared bitmask holds a step's rows, then as many prefill slots (prefill_masks).
        self._step_rows = step_rows
        self._bitmask_t = torch.from_numpy(workers.bitmask.array)
        self._prefill: PendingMasks | None = None  # the prefill batch in flight, if any
        self._pin = False  # page-lock the bitmask for CUDA copies (pin_for_cuda)
        self._prefill_gen = 0  # bumped by each prefill: only the latest one's slots are valid

    @staticmethod
    def new_bitmask(step_rows: int, width: int) -> SharedBitmask:
        """A shared bitmask for ``step_rows`` rows and as many prefill slots."""
        return SharedBitmask(2 * step_rows, width)

    @property
    def shared(self) -> SharedBitmask:
        """The shared bitmask the mask workers write into now."""
        return self._workers.bitmask

    @property
    def prefill_in_flight(self) -> bool:
        """A prefill batch was sent and is not collected yet."""
        return self._prefill is not None

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        """``[rows, ceil(vocab/32)]`` int32, all bits set (= no constraint)."""
        return torch.from_numpy(allocate_bitmask(rows, self.vocab_size))

    def pin_for_cuda(self) -> bool:
        """Keep the shared bitmask page-locked (now and after it grows), so steps copy their
        rows to the GPU asynchronously. False where CUDA cannot do it (copies still work)."""
        self._pin = self.shared.pin()
        return self._pin

    def prefill_masks(self, handles: Sequence[MatcherHandle]) -> None:
        """Start filling, for each handle, the mask of its matcher's current state, into a
        slot of the shared bitmask, without waiting. The engine calls this right after a
        step's ``advance`` for the requests that go on, so the workers compute the next
        step's masks while the engine detokenizes, schedules and builds the next step's
        inputs (and, on GPU, while the forward runs) instead of inside the next step.
        ``fill_bitmask_async`` then copies a prefilled row instead of asking the worker again,
        if nothing changed the matcher in between (any other operation on it, or a later
        prefill, makes the slot stale). One prefill batch is in flight at a time; any other
        work sent to the workers first waits for it."""
        self.settle_prefill()
        self._prefill_gen += 1
        todo = [h for h in handles if h.failure is None][: self._step_rows]
        if not todo:
            return
        rows = [(self._step_rows + j, h) for j, h in enumerate(todo)]
        batch = self._submit_fills(rows)
        for row, h in rows:
            h.prefilled = (self._prefill_gen, row)
        self._prefill = PendingMasks(self, batch, rows, None)

    def settle_prefill(self) -> None:
        """Collect the prefill batch in flight (a worker takes one batch at a time). Its
        failures land on the handles, as a fill's do; their slots are never used."""
        pending, self._prefill = self._prefill, None
        if pending is not None:
            pending.wait()

    def drop_prefill(self) -> None:
        """Forget the prefill in flight and every slot (its workers are being killed)."""
        pending, self._prefill = self._prefill, None
        if pending is not None:
            pending.abandon()
        self._prefill_gen += 1

    def step_bitmask(self, rows: int) -> torch.Tensor:
        """A bitmask of ``rows`` rows, all bits set, in the memory the mask workers write to:
        the engine's per-step bitmask (valid until the next call)."""
        self._ensure_rows(rows)
        view = self._bitmask_t[:rows]
        view.fill_(-1)
        return view

    def _ensure_rows(self, rows: int) -> None:
        if rows <= self._step_rows:
            return
        # Rare (the engine sizes it to max_num_seqs): a bigger buffer, and mask workers
        # restarted to map it; their matchers are rebuilt on next use.
        self.drop_prefill()
        self._step_rows = max(rows, 2 * self._step_rows)
        bitmask = self.new_bitmask(self._step_rows, self.width)
        self._bitmask_t = torch.from_numpy(bitmask.array)
        if self._pin:
            bitmask.pin()
        self._workers.map_bitmask(bitmask)

    def fill_bitmask_async(
        self, rows_and_handles: Sequence[tuple[int, MatcherHandle]], bitmask: torch.Tensor | np.ndarray | None = None
    ) -> PendingMasks:
        """Start filling ``bitmask[row]`` for each ``(row, handle)``; rows not listed keep their
        contents. ``bitmask`` from ``step_bitmask`` is written in place; another tensor or
        array gets the rows copied in by ``wait()``."""
        rows = list(rows_and_handles)
        if not rows:
            return PendingMasks(self, None, rows, bitmask)
        self._ensure_rows(max(r for r, _ in rows) + 1)
        if self._prefill is not None and all(
            h.prefilled is not None and h.prefilled[0] == self._prefill_gen for _, h in rows
        ):
            # Every row's mask is in the prefill still running: wait for it in wait(), after
            # the forward, not before it (the steady state of a constrained batch).
            return PendingMasks(self, None, rows, bitmask, start=lambda: self._start_fill(rows))
        return PendingMasks(self, self._start_fill(rows), rows, bitmask)

    def _start_fill(self, rows: list[tuple[int, MatcherHandle]]) -> MatcherBatch:
        """Copy the rows prefilled since (after the prefill in flight is collected); send the
        others to the workers."""
        self.settle_prefill()
        # Rows whose mask prefill_masks already filled are copied from their slot; the
        # others are filled now.
        shared = self.shared.array
        copy_to, copy_from, todo = [], [], []
        for row, h in rows:
            p, h.prefilled = h.prefilled, None
            if p is not None and p[0] == self._prefill_gen and h.failure is None:
                copy_to.append(row)
                copy_from.append(p[1])
            else:
                todo.append((row, h))
        if copy_to:
            shared[copy_to] = shared[copy_from]
            self._batches.stats["prefilled_rows"] += len(copy_to)
        return self._submit_fills(todo)

    def _submit_fills(self, rows: list[tuple[int, MatcherHandle]]) -> MatcherBatch:
        """Send a fill of each ``(row, handle)`` to the workers, without waiting."""
        return self._batches.start([Entry(h, ("fill", row), h.mask_timeout_s) for row, h in rows])

    def fill_bitmask(
        self, rows_and_handles: Sequence[tuple[int, MatcherHandle]], bitmask: torch.Tensor | np.ndarray | None = None
    ) -> list[MatcherHandle]:
        return self.fill_bitmask_async(rows_and_handles, bitmask).wait()

    def finish_fill(self, rows: list[tuple[int, MatcherHandle]], dest: Any) -> list[MatcherHandle]:
        """After the fill of ``rows`` came back: fail the rows that allow no token, open the
        failed ones, copy the rows into ``dest`` unless it is the shared bitmask; the handles
        that failed."""
        shared = self.shared.array
        idx = np.fromiter((r for r, _ in rows), dtype=np.int64, count=len(rows))
        # A row that allows no token at all (xgrammar's mask at a dead end of the spec, where
        # llguidance allows EOS only): sampling it would pick from -inf everywhere.
        empty = ~shared[idx].any(axis=1)
        failed = []
        for (row, h), no_token in zip(rows, empty):
            if h.failure is None and no_token:
                h.dead_end = True
                self._batches.fail(h, f"{h.backend_name}: the mask allowed no token at all", evict=False)
            if h.failure is not None:
                shared[row] = -1  # any row will do: the request fails after this step
                failed.append(h)
        if dest is not None and not (isinstance(dest, torch.Tensor) and dest.data_ptr() == shared.ctypes.data):
            src = torch.from_numpy(shared[idx])
            if isinstance(dest, torch.Tensor):
                dest[torch.from_numpy(idx)] = src.to(dest.device)
            else:
                dest[idx] = shared[idx]
        return failed
