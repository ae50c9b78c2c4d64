"""The engine's side of its requests' grammar matchers.

A ``MatcherHandle`` is what a request holds: the matcher itself lives in a mask worker
(``worker.py``); the handle keeps what the engine reads between steps and the tokens the
matcher accepted, from which a restarted worker rebuilds it. Its one-off calls go to its
``MatcherOwner`` (``matching.MatcherService``, made by ``GrammarManager``); batches of work
on many matchers are ``batch.MatcherBatch``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

from .base import CompiledGrammar
from .host import ADVANCE_FIELDS
from .pool import Live

__all__ = ["Advance", "MatcherHandle", "MatcherOwner"]


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


class MatcherOwner(Protocol):
    """What a handle asks of whoever made it (``matching.MatcherService``)."""

    def run_one(self, h: "MatcherHandle", item: tuple) -> Any:
        """One operation on one matcher; GrammarError if it failed."""

    def fill_bitmask(self, rows_and_handles: Sequence[tuple[int, "MatcherHandle"]], bitmask: Any) -> list:
        """Fill mask rows; the handles that failed."""


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
        "_owner",
        "__weakref__",
    )

    def __init__(self, owner: MatcherOwner, compiled: CompiledGrammar, live: Live, mask_timeout_s: float):
        self._owner = owner
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
        return bool(self._owner.run_one(self, ("accept", list(tokens))))

    def rollback(self, n: int) -> None:
        self._owner.run_one(self, ("rollback", int(n)))

    def forced_tokens(self) -> list[int]:
        return list(self._owner.run_one(self, ("forced",)) or [])

    def at_dead_end(self) -> bool:
        return bool(self._owner.run_one(self, ("dead_end",)))

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self._owner.fill_bitmask([(row, self)], bitmask)
