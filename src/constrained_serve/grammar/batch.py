"""Batches of operations on requests' matchers, sent to the mask workers and collected with
recovery.

A ``MatcherBatch`` sends the operations of one step to the workers (one round trip per
worker) and collects them with recovery: a worker that overran an item's deadline or died is
restarted, the matcher it was working on fails (and any in the same grammar state with it),
the others are rebuilt and their work retried. What a batch needs around it (the worker pool,
failing a matcher, the deadline of rebuilds, the counters) is its ``BatchContext``.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Any

from .base import CompiledGrammar
from .matchers import MatcherHandle
from .pool import WorkerPool, portable
from .worker import WorkerFailure, collect_all

logger = logging.getLogger(__name__)

__all__ = ["BatchContext", "Entry", "MatcherBatch"]


class Entry:
    """One matcher operation of a batch, with its outcome."""

    __slots__ = ("handle", "item", "deadline", "ok", "value")

    def __init__(self, handle: MatcherHandle, item: tuple, deadline: float):
        self.handle, self.item, self.deadline = handle, item, deadline
        self.ok: bool | None = None
        self.value: Any = None


class BatchContext:
    """What batches share: the worker pool, failing a matcher (which evicts its grammar from
    the compile cache), the deadline of rebuilding grammars and matchers in a worker
    (``setup_timeout_s``: the manager's ``compile_timeout_s``) and the manager's counters."""

    def __init__(
        self,
        workers: WorkerPool,
        evict: Callable[[CompiledGrammar], None],
        setup_timeout_s: float,
        stats: dict[str, int],
    ):
        self.workers = workers
        self.evict = evict
        self.setup_timeout_s = setup_timeout_s
        self.stats = stats

    def fail(self, h: MatcherHandle, reason: str, evict: bool = True) -> None:
        """``h`` fails with ``reason`` (the first reason stays); its grammar is evicted unless
        ``evict`` is False (a failure that says nothing against the grammar)."""
        if h.failure is None:
            h.failure = reason
            if evict:
                self.evict(h.compiled)

    def start(self, entries: list[Entry]) -> "MatcherBatch":
        """A batch of ``entries``, sent."""
        return MatcherBatch(self, entries).start()


class MatcherBatch:
    """Matcher operations sent to the mask workers, collected with recovery: a worker that
    overran or died is restarted, the culprit's handle fails, the rest are replayed and retried."""

    def __init__(self, ctx: BatchContext, entries: list[Entry]):
        self.ctx = ctx
        self.todo: dict[Any, list[Entry]] = collections.defaultdict(list)
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
                    self.ctx.fail(en.handle, f"the grammar worker could not start: {e}")
                    en.ok, en.value = False, en.handle.failure
                del self.todo[client]
                continue
            for item in self.ctx.workers.owed_to(client):
                owners.append(("prologue", None))
                items.append(item)
                deadlines.append(self.ctx.setup_timeout_s)
            loaded = self.ctx.workers.loaded_in(client)
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
                        deadlines.append(self.ctx.setup_timeout_s)
                    owners.append(("new", h))
                    items.append(("new", h.live.mid, gid, list(h.history)))
                    deadlines.append(self.ctx.setup_timeout_s)
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

    def start(self) -> "MatcherBatch":
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
                self.ctx.workers.retire(owner)
                self.ctx.workers.loaded_in(client).discard(owner)
                for en in self.todo[client]:
                    if en.handle.compiled.gid == owner:
                        self.ctx.fail(en.handle, f"the grammar could not be rebuilt in a worker: {value[1]}")
            elif kind == "new":
                if ok:
                    owner.live.epoch = client.epoch
                else:
                    self.ctx.fail(owner, value[1])
            elif kind == "op":
                h = owner.handle
                if h.failure is not None:
                    owner.ok, owner.value = False, h.failure
                elif ok:
                    owner.ok, owner.value = True, value
                else:
                    self.ctx.fail(h, f"{value[0]}: {value[1]}")
                    owner.ok, owner.value = False, h.failure

    def _recover(self, client: Any, owners: list[tuple[str, Any]], failure: WorkerFailure) -> None:
        self.ctx.stats["worker_restarts"] += 1
        kind, owner = owners[failure.index] if 0 <= failure.index < len(owners) else ("unknown", None)
        what = "overran its deadline" if failure.overrun else "crashed"
        if kind == "load":
            self.ctx.workers.retire(owner)
            for en in self.todo[client]:
                if en.handle.compiled.gid == owner:
                    self.ctx.fail(en.handle, f"rebuilding the grammar in a worker {what}; the worker was killed")
        elif kind in ("new", "op"):
            h = owner if kind == "new" else owner.handle
            op = _WORK.get("new" if kind == "new" else owner.item[0], f"the {owner.item[0]} operation")
            limit = self.ctx.setup_timeout_s if kind == "new" else owner.deadline
            reason = (
                f"{h.backend_name}: {op} took longer than its deadline of {limit:g} s of CPU time (with "
                f"{len(h.history)} tokens accepted); the grammar worker was killed"
                if failure.overrun
                else f"{h.backend_name}: the grammar worker crashed during {op} ({failure})"
            )
            if failure.overrun:
                self.ctx.stats["mask_overruns"] += 1
            self.ctx.fail(h, reason)
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
                    self.ctx.fail(o, reason + " (the same grammar state as another request)")
        else:
            self.attempts[client] += 1
            if self.attempts[client] >= 2:  # no culprit, twice: give up on this batch
                for en in self.todo[client]:
                    self.ctx.fail(en.handle, f"the grammar worker failed twice without a culprit ({failure})")
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
