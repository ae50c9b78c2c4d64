"""The grammar interface shared by both engines (two levels, as in vLLM v1).

Engine level (``GrammarBackend``): compile a spec once, make matchers, fill bitmask rows.
Request level (``GrammarMatcher``): accept tokens, fill its row, forced tokens, rollback.

These objects run the grammar engines in-process and unbounded; the engine reaches them only
through worker processes (``host.py`` inside them, ``manager.py`` outside), where a runaway
can be killed. They work on numpy bitmasks so a worker needs no torch.

Bitmask layout, identical for every backend so one sampling kernel serves all: an int32
tensor ``[rows, ceil(vocab_size / 32)]`` where bit ``t % 32`` of word ``t // 32`` is set iff
token ``t`` is allowed. ``vocab_size`` is the model's logits width; ids past the
tokenizer's vocabulary are never allowed. EOS ids are allowed exactly where the grammar
may end; a finished matcher's row allows EOS only, so a row is never all-masked.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import GrammarError
from ..params import OutputSpec
from .tokenizer_data import TokenizerData

__all__ = ["CompiledGrammar", "GrammarBackend", "GrammarMatcher", "allocate_bitmask", "allowed_tokens", "bitmask_width"]


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> np.ndarray:
    """``[rows, ceil(vocab/32)]`` int32, all bits set (= no constraint)."""
    return np.full((rows, bitmask_width(vocab_size)), -1, dtype=np.int32)


def allowed_tokens(row: np.ndarray, vocab_size: int) -> np.ndarray:
    """One int32 bitmask row -> bool [vocab_size] (True = allowed)."""
    return np.unpackbits(np.ascontiguousarray(row).view(np.uint8), bitorder="little")[:vocab_size].astype(bool)


@dataclass(eq=False)
class CompiledGrammar:
    """A compiled, immutable grammar; share it between any number of matchers."""

    backend: str
    spec: OutputSpec
    handle: Any  # the engine's own compiled object (None outside the process that holds it)
    compile_s: float = 0.0
    warnings: list[str] = field(default_factory=list)
    gid: int = -1  # the manager's id of this compile: worker processes key their copies by it
    payload: str = ""  # what rebuilds ``handle`` in another process (GrammarBackend.load)


class GrammarMatcher(abc.ABC):
    """Per-request grammar state. Not thread-safe: one request, one matcher."""

    backend_name: str = "abstract"  # the GrammarBackend.name that made it

    @abc.abstractmethod
    def accept_tokens(self, tokens: Sequence[int]) -> bool:
        """Advance by ``tokens``. False if any is rejected; the state is then unchanged."""

    def accept_sampled(self, token: int) -> bool:
        """``accept_tokens([token])`` for a token drawn under this state's own mask, as a
        step's sampled tokens are: a refusal ends the request, so a backend may leave the
        state broken after one (llguidance does, to skip the check that keeps it)."""
        return self.accept_tokens([token])

    @abc.abstractmethod
    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed-next-token bits into ``bitmask[row]``."""

    @abc.abstractmethod
    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next, in canonical tokenization; [] if none. No state change."""

    @abc.abstractmethod
    def is_finished(self) -> bool:
        """True when the grammar admits nothing more: EOS was consumed, or (llguidance) the
        grammar stopped and only EOS may follow. The engine should then end the request."""

    @abc.abstractmethod
    def can_end(self) -> bool:
        """True when EOS is allowed now (the text so far is a complete match, EOS not yet taken)."""

    @abc.abstractmethod
    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens."""

    def error(self) -> str | None:
        """The backend's reason when it failed mid-output (a parser limit hit), else None.
        A failed matcher is neither finished nor usable: the engine aborts its request."""
        return None


class GrammarBackend(abc.ABC):
    """One grammar engine bound to one tokenizer and one model vocabulary width."""

    name: str = "abstract"

    def __init__(self, tokenizer: TokenizerData):
        self.tokenizer_data = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.eos_token_ids: list[int] = list(tokenizer.eos_token_ids)

    @abc.abstractmethod
    def compile(self, spec: OutputSpec) -> CompiledGrammar:
        """Compile ``spec``; raise ``GrammarError`` naming the reason and the offending part.
        The result's ``payload`` rebuilds it with ``load`` in another process."""

    @abc.abstractmethod
    def load(self, payload: str, spec: OutputSpec) -> CompiledGrammar:
        """Rebuild a grammar that ``compile`` accepted (in another process) from its payload."""

    @abc.abstractmethod
    def new_matcher(self, compiled: CompiledGrammar) -> GrammarMatcher:
        """A fresh matcher at the grammar's start."""

    def dead_end(self, matcher: GrammarMatcher) -> bool:
        """The matcher can neither go on nor stop: its mask allows no token but EOS (the
        backends' way out of a dead state), yet what it has read is not a complete match.
        A spec whose start is a dead end matches no text at all."""
        return not matcher.can_end() and self.only_eos_allowed(matcher)

    @abc.abstractmethod
    def matches(self, compiled: CompiledGrammar, text: str) -> bool:
        """``text`` as a whole is a complete match of the grammar, however it is tokenized
        (checks an output that a stop string cut at an arbitrary character)."""

    def spec_error(self, spec: OutputSpec, reason: str, prefix: str = "cannot compile") -> GrammarError:
        """The error every backend raises for a spec: the backend, what failed, the spec's
        start (up to 200 characters) and the reason."""
        snippet = spec.text if len(spec.text) <= 200 else spec.text[:200] + "..."
        return GrammarError(f"{self.name} {prefix} {spec.kind} {snippet!r}: {reason}", backend=self.name, reason=reason)

    def only_eos_allowed(self, matcher: GrammarMatcher) -> bool:
        """The matcher's next-token mask allows no token but EOS (one mask fill)."""
        row = allocate_bitmask(1, self.vocab_size)
        matcher.fill_bitmask(row, 0)
        allowed = allowed_tokens(row[0], self.vocab_size)
        allowed[[t for t in self.eos_token_ids if t < self.vocab_size]] = False
        return not bool(allowed.any())
