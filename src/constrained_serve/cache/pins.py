"""Conversation pins: an open conversation's hold on its cached history.

A pin locks the radix node of the history and takes one pool reference on each of its
pages, so eviction cannot take them while the conversation is open. Pins together may hold
at most ``lock_fraction`` of the pool; a history past that stays evictable (its next turn
recomputes what was evicted, never fails). When a request could not run at all otherwise,
the KV cache manager releases every pin (``release_all``); the history stays cached until
evicted and is pinned again at the conversation's next turn.

A conversation dropped without ``close()`` must not pin its history for good: the registry
keeps no reference to its owner, and a finalizer queues the owner's pin as orphaned, to be
released at the engine's next step. The collector may run the finalizer on any thread, even
mid-step, so it only queues: taking the engine's lock there deadlocked.

Every method takes the engine's lock (an RLock), the one its steps hold: the radix tree and
the page references are shared with them.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..engine.interrupts import sigint_deferred
from .pool import PagePool

if TYPE_CHECKING:
    from .radix import Node, RadixCache

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class HistoryPin:
    """The locked radix node and the referenced pages of one conversation's history."""

    node: "Node | None" = None
    pages: list[int] = field(default_factory=list)
    closed: bool = False

    def forget(self) -> None:
        """Hold nothing, giving nothing back (released, or the whole KV cache was reset)."""
        self.node, self.pages = None, []


class PinRegistry:
    def __init__(self, pool: PagePool, radix: "RadixCache | None", lock: threading.RLock, lock_fraction: float):
        self.pool, self.radix, self.lock = pool, radix, lock
        self.lock_fraction = lock_fraction
        self._open: set[HistoryPin] = set()
        self._orphaned: list[HistoryPin] = []  # appended by finalizers, on any thread

    def open(self, owner: Any) -> HistoryPin:
        """A new, empty pin for ``owner``; released when the owner is garbage-collected."""
        pin = HistoryPin()
        with self.lock:
            self._open.add(pin)
        weakref.finalize(owner, self._orphaned.append, pin)
        return pin

    def pin(self, pin: HistoryPin, token_ids: Sequence[int]) -> bool:
        """Lock the cached prefix of ``token_ids`` for ``pin`` (dropping what it held), unless
        the pin is closed, nothing is cached, or pins would exceed their share of the pool."""
        with self.lock:
            self.release_orphans()  # they count against the limit below
            self.release(pin)
            if pin.closed or self.radix is None:
                return False
            m = self.radix.match_prefix(list(token_ids))
            if m.num_tokens == 0:
                return False
            pinned = sum(len(p.pages) for p in self._open if p is not pin)
            limit = int(self.lock_fraction * self.pool.num_pages)
            if pinned + len(m.pages) > limit:
                logger.info("conversation history not pinned: pinned pages would exceed %d", limit)
                return False
            with sigint_deferred():  # a radix lock without its page references would leak
                self.radix.lock(m.node)
                self.pool.incref(m.pages)
                pin.node, pin.pages = m.node, list(m.pages)
            return True

    def release(self, pin: HistoryPin) -> None:
        """Give back the pin's radix lock and page references; idempotent."""
        with self.lock, sigint_deferred():  # an unlock without its decref would leak the pages
            if pin.node is not None:
                self.radix.unlock(pin.node)
                self.pool.decref(pin.pages)
            pin.forget()

    def close(self, pin: HistoryPin) -> None:
        """Release the pin for good: a turn still running cannot pin again after this."""
        with self.lock:
            pin.closed = True
            self.release(pin)
            self._open.discard(pin)

    def release_orphans(self) -> None:
        """Release the pins of conversations collected without close()."""
        with self.lock:
            while self._orphaned:
                self.close(self._orphaned.pop())

    def release_all(self) -> None:
        """Out of pages: make every open conversation's history evictable."""
        with self.lock:
            self.release_orphans()
            pinned = [p for p in self._open if p.pages]
            if pinned:
                logger.info("KV cache full: unpinning the history of %d open conversation(s)", len(pinned))
            for p in pinned:
                self.release(p)

    def forget_all(self) -> None:
        """The pool and the radix tree were reset: every pin holds nothing, giving nothing back."""
        with self.lock:
            for p in list(self._open) + self._orphaned:
                p.forget()
            for p in self._orphaned:
                self._open.discard(p)
            self._orphaned.clear()

    def holders(self) -> list[HistoryPin]:
        """Every pin that may hold pages (for the integrity checks)."""
        with self.lock:
            return list(self._open)  # an orphaned pin stays open until released

    def __len__(self) -> int:
        """Open pins (their conversations are neither closed nor collected, or not yet seen so)."""
        with self.lock:
            return len(self._open)
