"""The grammar objects of one backend in one process, and the operations the engine asks of them.

A ``MatcherHost`` keeps compiled grammars and matchers by integer id (the manager in the
engine's process hands the ids out) and runs a batch of operations, one item after the other,
calling ``progress(i)`` before item ``i``. In a worker process that callback stamps the item
and its start time into shared memory, so the engine's process can see which item overran its
deadline and kill the worker (``worker.py``); run in-process (``isolation="inline"``) the
same code has no deadline.

Items are tuples ``(op, *args)``; each result is ``(True, value)`` or ``(False, (error type,
message, reason))``, so one failing item never fails the others. The ops:

    compile gid spec        -> (payload, warnings, compile_s)   refuses specs that match no text
    load gid payload spec   -> None        rebuild a grammar compiled elsewhere
    unload gid              -> None
    new mid gid history     -> None        a matcher at the start, then ``history`` accepted (replay)
    drop mid                -> None
    advance mid tokens room stop_ids -> ADVANCE tuple (below): accept, then fast-forward
    fill mid row            -> None        the mask row, written into the shared bitmask
    accept mid tokens / rollback mid n / forced mid / state mid / dead_end mid / matches gid text
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import GrammarError
from ..params import OutputSpec
from .base import CompiledGrammar, GrammarBackend, GrammarMatcher
from .finite_specs import check_can_end
from .tokenizer_data import TokenizerData

logger = logging.getLogger(__name__)

__all__ = ["ADVANCE_FIELDS", "OPS", "FaultPlan", "InlineClient", "MatcherHost", "make_backend"]

Outcome = tuple[bool, Any]

# The fields of an ``advance`` result, in order (a plain tuple crosses the process boundary
# cheapest; the manager reads it as manager.Advance).
ADVANCE_FIELDS = ("accepted", "error", "dead_end", "finished_first", "can_end_first", "forced", "finished", "can_end")

# Every op a ``MatcherHost`` runs (see the module docstring); an item naming another one fails.
OPS = (
    "compile",
    "load",
    "unload",
    "matches",
    "new",
    "drop",
    "advance",
    "fill",
    "accept",
    "rollback",
    "forced",
    "state",
    "dead_end",
)


def make_backend(name: str, tokenizer: TokenizerData, **options: Any) -> GrammarBackend:
    if name == "llguidance":
        from .llguidance import LLGuidanceBackend

        return LLGuidanceBackend(tokenizer, **options)
    if name == "xgrammar":
        from .xgrammar import XGrammarBackend

        return XGrammarBackend(tokenizer, **options)
    raise GrammarError(f"unknown grammar backend {name!r}; expected 'llguidance' or 'xgrammar'", backend=name)


@dataclass(frozen=True)
class FaultPlan:
    """Faults injected into mask fills, for the engine's fault-injection tests: each fill raises,
    spins for ``stall_s`` or writes random bits with the given probabilities. Read from the
    environment variable CONSTRAINED_SERVE_GRAMMAR_FAULTS ("raise=0.02,stall=0.02,garbage=0.02,
    stall_s=2,seed=0") by the worker processes the engine starts; never set in normal use."""

    p_raise: float = 0.0
    p_stall: float = 0.0
    p_garbage: float = 0.0
    stall_s: float = 2.0
    seed: int = 0

    ENV = "CONSTRAINED_SERVE_GRAMMAR_FAULTS"

    @classmethod
    def from_env(cls) -> "FaultPlan | None":
        text = os.environ.get(cls.ENV, "").strip()
        if not text:
            return None
        names = {"raise": "p_raise", "stall": "p_stall", "garbage": "p_garbage", "stall_s": "stall_s", "seed": "seed"}
        kw: dict[str, Any] = {}
        for part in text.split(","):
            key, _, value = part.partition("=")
            if key.strip() not in names:
                raise ValueError(f"{cls.ENV}: unknown key {key.strip()!r} (expected {sorted(names)})")
            kw[names[key.strip()]] = int(value) if key.strip() == "seed" else float(value)
        return cls(**kw)


class MatcherHost:
    def __init__(self, backend: GrammarBackend, bitmask: np.ndarray | None = None, faults: FaultPlan | None = None):
        self.backend = backend
        self.bitmask = bitmask  # [rows, width] int32 shared with the engine (mask workers only)
        self.grammars: dict[int, CompiledGrammar] = {}
        self.matchers: dict[int, GrammarMatcher] = {}
        self._faults = faults
        # The process id too: a restarted worker must not replay the faults that killed the last one.
        self._rng = random.Random(f"{faults.seed if faults else 0}-{os.getpid()}")
        # The ops a batch may name (the module docstring's list), and nothing else.
        self._ops: dict[str, Callable[..., Any]] = {
            "compile": self._compile,
            "load": self._load,
            "unload": self._unload,
            "matches": self._matches,
            "new": self._new,
            "drop": self._drop,
            "advance": self._advance,
            "fill": self._fill,
            "accept": self._accept,
            "rollback": self._rollback,
            "forced": self._forced,
            "state": self._state,
            "dead_end": self._dead_end,
        }
        assert tuple(self._ops) == OPS

    def run(self, items: Sequence[tuple], progress: Callable[[int], None] | None = None) -> list[Outcome]:
        out: list[Outcome] = []
        for i, item in enumerate(items):
            if progress is not None:
                progress(i)
            try:
                out.append((True, self._op(item[0])(*item[1:])))
            except Exception as e:  # noqa: BLE001 - one item's failure is that item's result
                out.append((False, (type(e).__name__, str(e) or repr(e), getattr(e, "reason", None))))
        return out

    def _op(self, name: str) -> Callable[..., Any]:
        op = self._ops.get(name)
        if op is None:
            raise ValueError(f"unknown grammar worker op {name!r}; expected one of {', '.join(OPS)}")
        return op

    # -- grammars ------------------------------------------------------------------------
    def _compile(self, gid: int, spec: OutputSpec) -> tuple[str, list[str], float]:
        b = self.backend
        check_can_end(spec, b.name)  # the same refusal from both backends
        compiled = b.compile(spec)
        # Refused at submit like any bad spec, rather than aborting mid-batch.
        m = b.new_matcher(compiled)
        if b.dead_end(m):
            if (err := m.error()) is not None:  # a limit hit on the way, not an empty spec
                raise b.spec_error(
                    spec, f"{err} (the spec is too large for {b.name}'s limits; another grammar_backend may take it)"
                )
            raise GrammarError(
                f"{b.name}: the {spec.kind} spec matches no text at all (nothing can be generated from its start)",
                backend=b.name,
                reason="matches no text",
            )
        self.grammars[gid] = compiled
        return compiled.payload, compiled.warnings, compiled.compile_s

    def _load(self, gid: int, payload: str, spec: OutputSpec) -> None:
        if gid not in self.grammars:
            self.grammars[gid] = self.backend.load(payload, spec)

    def _unload(self, gid: int) -> None:
        self.grammars.pop(gid, None)

    def _matches(self, gid: int, text: str) -> bool:
        compiled = self.grammars[gid]
        if self.backend.matches(compiled, text):
            return True
        # A refusal may be a limit hit on the way (see _why_rejected), which leaves this
        # grammar broken: drop it (the next check rebuilds it) and say so.
        m = self.backend.new_matcher(compiled)
        self.backend.dead_end(m)  # a mask: where a broken lexer shows
        err = m.error()
        if err is not None:
            del self.grammars[gid]
            raise GrammarError(
                f"{self.backend.name} failed while checking the output: {err}", backend=self.backend.name, reason=err
            )
        return False

    # -- matchers ------------------------------------------------------------------------
    def _new(self, mid: int, gid: int, history: Sequence[int]) -> None:
        m = self.backend.new_matcher(self.grammars[gid])
        if history and not m.accept_tokens(history):
            raise GrammarError(
                f"{self.backend.name}: replaying {len(history)} accepted tokens failed: "
                f"{m.error() or 'a token was refused'}",
                backend=self.backend.name,
                reason=m.error(),
            )
        self.matchers[mid] = m

    def _drop(self, mid: int) -> None:
        self.matchers.pop(mid, None)

    def _advance(self, mid: int, tokens: Sequence[int], room: int, stop_ids: Sequence[int]) -> tuple:
        """Accept ``tokens`` (the sampled one; none at a request's start), then take up to
        ``room`` tokens the grammar forces next (cut after the first of ``stop_ids``). What the
        engine checks in between (EOS, stop tokens and strings, length) it does with the
        ``*_first`` fields; it only uses ``forced`` when none of those ended the request."""
        m = self.matchers[mid]
        ok = m.accept_sampled(tokens[0]) if len(tokens) == 1 else m.accept_tokens(tokens)
        if not ok:
            err, dead = self._why_rejected(m)
            return (False, err, dead, False, False, [], False, False)
        finished_first, can_end_first = m.is_finished(), m.can_end()
        # Most rows (256 a step) have nothing forced: that path makes no call it can skip.
        ff = m.forced_tokens() if room > 0 and not finished_first else None
        if not ff:  # the state is the one read above (but finding no forced tokens can fail)
            return (True, m.error(), False, finished_first, can_end_first, [], finished_first, can_end_first)
        ff = ff[:room]
        if stop_ids:
            cut = next((i for i, t in enumerate(ff) if t in stop_ids), None)
            if cut is not None:
                ff = ff[: cut + 1]
        if not m.accept_tokens(ff):
            if (err := m.error()) is not None:
                return (True, err, False, finished_first, can_end_first, [], False, False)
            logger.warning("grammar refused its own forced tokens %s", ff)
            return (True, None, False, finished_first, can_end_first, [], finished_first, can_end_first)
        return (True, m.error(), False, finished_first, can_end_first, ff, m.is_finished(), m.can_end())

    def _why_rejected(self, m: GrammarMatcher) -> tuple[str | None, bool]:
        """(the backend's error, a dead end) for a matcher that refused tokens. The dead-end
        check computes a mask, which is also where llguidance reports a limit it hit while
        trying the tokens: past "too many expressions constructed" its lexer, shared with the
        grammar's other matchers, refuses everything (the manager then evicts the grammar)."""
        dead = self.backend.dead_end(m)
        err = m.error()
        return err, dead and err is None

    def _fill(self, mid: int, row: int) -> None:
        if self.bitmask is None:
            raise RuntimeError("this grammar worker has no shared bitmask")
        if self._faults is not None:
            self._inject(row)
        self.matchers[mid].fill_bitmask(self.bitmask, row)
        if self._faults is not None and self._rng.random() < self._faults.p_garbage:
            self.bitmask[row] = np.frombuffer(self._rng.randbytes(self.bitmask.shape[1] * 4), dtype=np.int32)
            if self._rng.random() < 0.25:
                self.bitmask[row] = 0  # a row that allows nothing at all

    def _inject(self, row: int) -> None:
        f = self._faults
        x = self._rng.random()
        if x < f.p_raise:
            raise RuntimeError(f"injected fault: mask fill of row {row} raised")
        if x < f.p_raise + f.p_stall:  # spins, as a runaway does (deadlines count CPU time)
            end = time.monotonic() + f.stall_s
            while time.monotonic() < end:
                pass

    def _accept(self, mid: int, tokens: Sequence[int]) -> bool:
        m = self.matchers[mid]
        if m.accept_tokens(tokens):
            return True
        err, _ = self._why_rejected(m)
        if err is not None:
            raise GrammarError(f"{self.backend.name} failed: {err}", backend=self.backend.name, reason=err)
        return False

    def _rollback(self, mid: int, n: int) -> None:
        self.matchers[mid].rollback(n)

    def _forced(self, mid: int) -> list[int]:
        return self.matchers[mid].forced_tokens()

    def _state(self, mid: int) -> tuple[bool, bool, str | None]:
        m = self.matchers[mid]
        return m.is_finished(), m.can_end(), m.error()

    def _dead_end(self, mid: int) -> bool:
        return self.backend.dead_end(self.matchers[mid])


class InlineClient:
    """A worker's interface over a ``MatcherHost`` in this process: no deadlines, no isolation."""

    inline = True
    busy = False
    alive = True
    pid = None

    def __init__(
        self, backend: str, tokenizer: TokenizerData, options: dict[str, Any], bitmask: Any, label: str = ""
    ):  # bitmask: a worker.SharedBitmask or None
        self.backend, self.label = backend, label or backend
        self._args = (backend, tokenizer, options)
        self.bitmask = bitmask
        self.host: MatcherHost | None = None
        self.epoch = 0
        self._results: list | None = None

    def start(self) -> None:
        if self.host is None:
            name, tokenizer, options = self._args
            self.host = MatcherHost(
                make_backend(name, tokenizer, **options), self.bitmask.array if self.bitmask else None
            )
            self.epoch += 1

    def submit(self, items: list[tuple], deadlines: Sequence[float]) -> None:
        self.start()
        self._results = self.host.run(items)

    def take(self) -> list:
        out, self._results = self._results, None
        return out

    def call(self, items: list[tuple], deadlines: Sequence[float]) -> list:
        self.submit(items, deadlines)
        return self.take()

    def kill(self) -> None:
        pass

    close = kill
