"""The engine's side of its requests' grammar matchers, and batches of work on them.

A ``MatcherHandle`` is what a request holds: the matcher itself lives in a mask worker
(``worker.py``); the handle keeps what the engine reads between steps and the tokens the
matcher accepted, from which a restarted worker rebuilds it. A ``_Batch`` sends the
operations of one step to the workers (one round trip per worker) and collects them with
recovery: a worker that overran an item's deadline or died is restarted, the matcher it was
working on fails (and any in the same grammar state with it), the others are rebuilt and
their work retried. ``GrammarManager`` (manager.py) is the front of all this.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from ..params import OutputSpec
from .base import CompiledGrammar
from .host import ADVANCE_FIELDS
from .worker import WorkerFailure, collect_all

if TYPE_CHECKING:
    from .manager import GrammarManager

logger = logging.getLogger(__name__)

__all__ = ["Advance", "MatcherHandle", "PendingMasks", "portable"]


class Advance(NamedTuple):
    """What ``GrammarManager.advance`` did for one matcher (see ``host.MatcherHost._advance``)."""

    accepted: bool  # the given tokens were accepted (else the state is unchanged)
    error: str | None  # the backend failed (a parser limit): the request must fail
    dead_end: bool  # refused because the spec allows nothing more from here
    finished_first: bool  # is_finished() right after the given tokens
    can_end_first: bool
    forced: list[int]  # tokens the grammar forced next, already accepted
    finished: bool  # after the forced tokens
    can_end: bool


assert Advance._fields == ADVANCE_FIELDS


class _Live:
    """A matcher's place in the workers (shared with its handle's finalizer)."""

    __slots__ = ("mid", "gid", "client", "epoch", "released")

    def __init__(self, mid: int, gid: int, client: Any):
        self.mid, self.gid, self.client = mid, gid, client
        self.epoch = 0  # the worker epoch its matcher was created in (0: not yet)
        self.released = False


class MatcherHandle:
    """A request's grammar matcher as the engine sees it. The matcher itself lives in a mask
    worker; this side keeps what the engine reads between steps (finished, can end, why it
    failed) and the tokens it accepted, from which a restarted worker rebuilds it."""

    __slots__ = (
        "compiled",
        "mask_timeout_s",
        "history",
        "finished",
        "can_end_now",
        "failure",
        "dead_end",
        "prefilled",
        "live",
        "_manager",
        "__weakref__",
    )

    def __init__(self, manager: "GrammarManager", compiled: CompiledGrammar, live: _Live, mask_timeout_s: float):
        self._manager = manager
        self.compiled = compiled
        self.live = live
        self.mask_timeout_s = mask_timeout_s
        self.history: list[int] = []  # accepted tokens, forced ones included
        self.finished = False
        self.can_end_now = False
        self.failure: str | None = None  # set once its grammar work failed: the request fails with it
        self.dead_end = False  # the failure: a mask that allowed no token (the spec cannot go on)
        # (prefill generation, slot row) of a mask already filled for the matcher's current
        # state (GrammarManager.prefill_masks); None when there is none or it went stale.
        self.prefilled: tuple[int, int] | None = None

    @property
    def backend_name(self) -> str:
        return self.compiled.backend

    # The engine reads these cached values; the calls below are one round trip each
    # (tests, scripts): the engine batches its calls through the manager instead.
    def can_end(self) -> bool:
        return self.can_end_now

    def is_finished(self) -> bool:
        return self.finished

    def error(self) -> str | None:
        return self.failure

    def accept_tokens(self, tokens: Sequence[int]) -> bool:
        return bool(self._manager._single(self, ("accept", list(tokens))))

    def rollback(self, n: int) -> None:
        self._manager._single(self, ("rollback", int(n)))

    def forced_tokens(self) -> list[int]:
        return list(self._manager._single(self, ("forced",)) or [])

    def at_dead_end(self) -> bool:
        return bool(self._manager._single(self, ("dead_end",)))

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self._manager.fill_bitmask([(row, self)], bitmask)


class _Entry:
    """One matcher operation of a batch, with its outcome."""

    __slots__ = ("handle", "item", "deadline", "ok", "value")

    def __init__(self, handle: MatcherHandle, item: tuple, deadline: float):
        self.handle, self.item, self.deadline = handle, item, deadline
        self.ok: bool | None = None
        self.value: Any = None


class PendingMasks:
    """Mask rows being filled by the workers (``GrammarManager.fill_bitmask_async``).
    ``wait()`` once; ``abandon()`` if the caller cannot wait (it kills the busy workers)."""

    def __init__(
        self,
        manager: "GrammarManager",
        batch: "_Batch | None",
        rows: list[tuple[int, MatcherHandle]],
        dest: Any,
        start: "Callable[[], _Batch] | None" = None,
    ):
        self._manager, self._batch, self._rows, self._dest = manager, batch, rows, dest
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
        return self._manager._finish_fill(self._rows, self._dest)

    def abandon(self) -> None:
        self._start = None
        if self._batch is not None:
            self._batch.abandon()
            self._batch = None


class PendingAdvance:
    """Grammar advances being run by the workers (``GrammarManager.advance_async``): the
    caller does other work meanwhile, then calls ``result()`` once."""

    def __init__(self, batch: "_Batch", finish: Callable[[], list]):
        self._batch: _Batch | None = batch
        self._finish = finish

    def result(self) -> list:
        if self._batch is not None:
            batch, self._batch = self._batch, None
            batch.finish()
        return self._finish()


class _Batch:
    """Matcher operations sent to the mask workers, collected with recovery: a worker that
    overran or died is restarted, the culprit's handle fails, the rest are replayed and retried."""

    def __init__(self, manager: "GrammarManager", entries: list[_Entry]):
        self.m = manager
        self.todo: dict[Any, list[_Entry]] = collections.defaultdict(list)
        for e in entries:
            if e.handle.failure is not None:
                e.ok, e.value = False, e.handle.failure
            else:
                self.todo[e.handle.live.client].append(e)
        self.sent: dict[Any, list[tuple[str, Any]]] = {}
        self.attempts: collections.Counter = collections.Counter()

    def submit(self) -> None:
        for client, entries in list(self.todo.items()):
            owners: list[tuple[str, Any]] = []
            items: list[tuple] = []
            deadlines: list[float] = []
            try:
                client.start()
            except WorkerFailure as e:
                for en in entries:
                    self.m._fail(en.handle, f"the grammar worker could not start: {e}")
                    en.ok, en.value = False, en.handle.failure
                del self.todo[client]
                continue
            for item in self.m._prologue(client):
                owners.append(("prologue", None))
                items.append(item)
                deadlines.append(self.m.compile_timeout_s)
            loaded = self.m._loaded_in(client)
            renewed: set[int] = set()
            for en in entries:
                h = en.handle
                if h.live.epoch != client.epoch and h.live.mid not in renewed:
                    renewed.add(h.live.mid)
                    gid = h.compiled.gid
                    if gid not in loaded:
                        loaded.add(gid)
                        owners.append(("load", gid))
                        items.append(("load", gid, h.compiled.payload, portable(h.compiled.spec)))
                        deadlines.append(self.m.compile_timeout_s)
                    owners.append(("new", h))
                    items.append(("new", h.live.mid, gid, list(h.history)))
                    deadlines.append(self.m.compile_timeout_s)
                owners.append(("op", en))
                items.append((en.item[0], h.live.mid) + tuple(en.item[1:]))
                deadlines.append(en.deadline)
            client.submit(items, deadlines)
            self.sent[client] = owners

    def collect(self) -> None:
        while self.sent:
            clients = list(self.sent)
            outcomes = collect_all(clients)
            for client, outcome in zip(clients, outcomes):
                owners = self.sent.pop(client)
                if isinstance(outcome, WorkerFailure):
                    self._recover(client, owners, outcome)
                else:
                    self._apply(client, owners, outcome)
                    del self.todo[client]
            if self.todo:
                self.submit()

    def start(self) -> "_Batch":
        """``submit``; the workers of a batch that fails to go out are killed."""
        try:
            self.submit()
        except BaseException:
            self.abandon()
            raise
        return self

    def finish(self) -> None:
        """``collect``; the workers of a batch that fails to come back are killed."""
        try:
            self.collect()
        except BaseException:
            self.abandon()
            raise

    def abandon(self) -> None:
        for client in self.sent:
            client.kill()
        self.sent.clear()
        self.todo.clear()

    def _apply(self, client: Any, owners: list[tuple[str, Any]], outcome: list[tuple[bool, Any]]) -> None:
        for (kind, owner), (ok, value) in zip(owners, outcome):
            if kind == "load" and not ok:
                self.m._retire(owner)
                self.m._loaded_in(client).discard(owner)
                for en in self.todo[client]:
                    if en.handle.compiled.gid == owner:
                        self.m._fail(en.handle, f"the grammar could not be rebuilt in a worker: {value[1]}")
            elif kind == "new":
                if ok:
                    owner.live.epoch = client.epoch
                else:
                    self.m._fail(owner, value[1])
            elif kind == "op":
                h = owner.handle
                if h.failure is not None:
                    owner.ok, owner.value = False, h.failure
                elif ok:
                    owner.ok, owner.value = True, value
                else:
                    self.m._fail(h, f"{value[0]}: {value[1]}")
                    owner.ok, owner.value = False, h.failure

    def _recover(self, client: Any, owners: list[tuple[str, Any]], failure: WorkerFailure) -> None:
        self.m.stats["worker_restarts"] += 1
        kind, owner = owners[failure.index] if 0 <= failure.index < len(owners) else ("unknown", None)
        what = "overran its deadline" if failure.overrun else "crashed"
        if kind == "load":
            self.m._retire(owner)
            for en in self.todo[client]:
                if en.handle.compiled.gid == owner:
                    self.m._fail(en.handle, f"rebuilding the grammar in a worker {what}; the worker was killed")
        elif kind in ("new", "op"):
            h = owner if kind == "new" else owner.handle
            op = _WORK.get("new" if kind == "new" else owner.item[0], f"the {owner.item[0]} operation")
            limit = self.m.compile_timeout_s if kind == "new" else owner.deadline
            reason = (
                f"{h.backend_name}: {op} took longer than its deadline of {limit:g} s of CPU time (with "
                f"{len(h.history)} tokens accepted); the grammar worker was killed"
                if failure.overrun
                else f"{h.backend_name}: the grammar worker crashed during {op} ({failure})"
            )
            if failure.overrun:
                self.m.stats["mask_overruns"] += 1
            self.m._fail(h, reason)
            # Matchers in the same state would run away the same way: fail them with it.
            for en in self.todo[client]:
                o = en.handle
                if (
                    o is not h
                    and o.failure is None
                    and o.compiled.gid == h.compiled.gid
                    and o.history == h.history
                    and (kind == "new" or en.item == owner.item)
                ):
                    self.m._fail(o, reason + " (the same grammar state as another request)")
        else:
            self.attempts[client] += 1
            if self.attempts[client] >= 2:  # no culprit, twice: give up on this batch
                for en in self.todo[client]:
                    self.m._fail(en.handle, f"the grammar worker failed twice without a culprit ({failure})")
        logger.warning("%s", failure)
        remaining = []
        for en in self.todo[client]:
            if en.handle.failure is not None:
                en.ok, en.value = False, en.handle.failure
            else:
                remaining.append(en)
        if remaining:
            self.todo[client] = remaining
        else:
            del self.todo[client]


# What an operation that overran was doing, in a user's words.
_WORK = {
    "new": "rebuilding the matcher",
    "advance": "accepting the sampled token and finding the forced ones",
    "fill": "computing the next-token mask",
    "accept": "accepting tokens",
    "forced": "finding the forced tokens",
    "state": "checking the matcher's state",
    "dead_end": "checking for a dead end",
}


def portable(spec: OutputSpec) -> OutputSpec:
    """The spec without its Python type (a user's class need not be importable in a worker)."""
    return dataclasses.replace(spec, python_type=None) if spec.python_type is not None else spec
