"""Continuous batching with a per-step token budget and stall-free chunked prefill.

Each step: running requests with one pending token (decodes) first, oldest first; then
running requests with several pending tokens (unfinished prefills, fast-forwarded tokens);
then waiting requests are admitted in order while the token budget, ``max_num_seqs`` and the
page pool allow. A long prompt therefore takes only what the decodes leave over and never
freezes them (Sarathi-Serve). When pages run out, the KV manager first evicts unused cached
prefixes; if that is not enough the newest running request is preempted (its pages freed,
recomputed later) — never a deadlock, never a crash.
"""

from __future__ import annotations

import logging
from collections import deque

from ..cache.manager import KVCacheManager
from .batch import Batch, ScheduledChunk
from .request import Request, Status

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order (oldest first)
        # Every request added and not finished, wherever it is (an interrupt can leave one
        # in neither queue, between two statements of _admit).
        self.unfinished: dict[int, Request] = {}
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.unfinished[request.request_id] = request
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> Batch:
        budget = self.max_num_batched_tokens
        scheduled: dict[int, ScheduledChunk] = {}
        order: list[Request] = [r for r in self.running if r.num_pending == 1]
        order += [r for r in self.running if r.num_pending > 1]
        room = self.kv.page_size
        for r in order:
            if budget <= 0:
                break
            if r.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            n = min(r.num_pending, budget)
            # Most decodes still have room in their last page: no page work at all.
            if r.num_computed + n > len(r.pages) * room and not self._reserve(r, r.num_computed + n, scheduled):
                continue  # r itself was preempted
            scheduled[r.request_id] = ScheduledChunk(r, n, sample=(n == r.num_pending))
            budget -= n
        self._admit(budget, scheduled)
        chunks = list(scheduled.values())
        # Decode chunks first: the attention kernels take them as one group.
        chunks.sort(key=lambda c: c.num_new != 1)
        return Batch(chunks)

    def _reserve(self, r: Request, num_tokens: int, scheduled: dict[int, ScheduledChunk]) -> bool:
        """Make r hold pages for num_tokens, preempting the newest unscheduled runners if needed."""
        while not self.kv.ensure_pages(r, num_tokens):
            victim = next((v for v in reversed(self.running) if v.request_id not in scheduled and v is not r), None)
            if victim is None:
                # r alone: giving way itself would leave nothing running, and it could never
                # come back while history pins hold the pages. Those go first.
                if len(self.running) == 1 and self.kv.ensure_pages(r, num_tokens, unpin=True):
                    return True
                self._preempt(r)
                return False
            self._preempt(victim)
        return True

    def _admit(self, budget: int, scheduled: dict[int, ScheduledChunk]) -> None:
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            r = self.waiting.popleft()
            if r.compiling or r.pending_row is not None:
                # Its grammar is compiling, or compiled but not attached yet (the engine
                # attaches matchers before the next schedule), or it was preempted with its
                # last token still on the device (engine.py's pipelined loop reads it after
                # this schedule): let the others go ahead.
                skipped.append(r)
                continue
            self.kv.match_prefix(r)
            if self._prefix_in_flight(r, scheduled):
                # A running request is computing the very next page of r's prompt right now:
                # wait one step and reuse it from the cache instead of computing it twice.
                self._not_admitted(r)
                skipped.append(r)
                continue
            n = min(r.num_pending, budget)
            # With nothing running, pinned history is all that can stand in r's way.
            if not self.kv.ensure_pages(r, r.num_computed + n, unpin=not self.running):
                self._not_admitted(r)
                self.waiting.appendleft(r)
                break
            r.status = Status.RUNNING
            self.running.append(r)
            scheduled[r.request_id] = ScheduledChunk(r, n, sample=(n == r.num_pending))
            budget -= n
        for r in reversed(skipped):
            self.waiting.appendleft(r)

    def _not_admitted(self, r: Request) -> None:
        """Undo match_prefix for a request that goes back to the queue: its pages, and the
        cache hit it would have had (counted again at the admission that happens; the
        prefix may be longer then, or evicted)."""
        self.kv.release(r, cache_tokens=False)
        r.num_computed = 0
        if r.num_preemptions == 0:
            r.num_cached = 0

    def _prefix_in_flight(self, r: Request, scheduled: dict[int, ScheduledChunk]) -> bool:
        """Does a prefilling request share r's first uncached page (in-batch prefix sharing)?"""
        if self.kv.radix is None or r.prompt_logprobs is not None:  # it would not reuse the page
            return False
        ps = self.kv.page_size
        start = r.num_computed
        end = start + ps
        if end >= r.num_tokens:  # less than a page left to compute: nothing to share
            return False
        head = r.token_ids[:end]
        for other in self.running:
            c = scheduled.get(other.request_id)
            # other will hold the page [start, end) after this step (or already computes it).
            upto = other.num_computed + (c.num_new if c is not None else 0)
            if upto > start and other.num_tokens >= end and other.token_ids[:end] == head:
                return True
        return False

    def _preempt(self, r: Request) -> None:
        logger.debug("preempting request %d (%d tokens)", r.request_id, r.num_tokens)
        self.kv.release(r, cache_tokens=True)
        r.num_computed = 0
        r.status = Status.WAITING
        r.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(r)
        self.waiting.appendleft(r)

    # ------------------------------------------------------------------ finish
    def drop_all(self) -> list[Request]:
        """Forget every unfinished request, leaving their pages alone, and return them. For a
        step cut short: queues and page tables may disagree, so the caller resets the whole
        KV cache instead of releasing pages one request at a time."""
        dropped = list(self.unfinished.values())
        for r in dropped:
            r.pages, r.cache_node, r.num_shared = [], None, 0
            r.status = Status.FINISHED
        self.unfinished.clear()
        self.waiting.clear()
        self.running.clear()
        return dropped

    def finish(self, r: Request, reason: str) -> None:
        self.unfinished.pop(r.request_id, None)
        r.finish_reason = reason
        if r.status is Status.RUNNING:
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)
        self.kv.release(r, cache_tokens=True)
        r.status = Status.FINISHED
