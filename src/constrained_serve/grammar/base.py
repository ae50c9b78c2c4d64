"""The grammar interface shared by both engines (two levels, as in vLLM v1).

Engine level (``GrammarBackend``): compile a spec once, make matchers, fill bitmask rows.
Request level (``GrammarMatcher``): accept tokens, fill its row, forced tokens, rollback.

Bitmask layout, identical for every backend so one sampling kernel serves all: an int32
tensor ``[rows, ceil(vocab_size / 32)]`` where bit ``t % 32`` of word ``t // 32`` is set iff
token ``t`` is allowed. ``vocab_size`` is the model's logits width; ids past the
tokenizer's vocabulary are never allowed. EOS ids are allowed exactly where the grammar
may end; a finished matcher's row allows EOS only, so a row is never all-masked.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..kernels.sampling import unpack_bitmask
from ..params import OutputSpec

__all__ = ["CompiledGrammar", "GrammarBackend", "GrammarMatcher", "allocate_bitmask", "bitmask_width"]


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """``[rows, ceil(vocab/32)]`` int32, all bits set (= no constraint)."""
    return torch.full((rows, bitmask_width(vocab_size)), -1, dtype=torch.int32)


@dataclass(eq=False)
class CompiledGrammar:
    """A compiled, immutable grammar; share it between any number of matchers."""

    backend: str
    spec: OutputSpec
    handle: Any  # the engine's own compiled object
    compile_s: float = 0.0
    warnings: list[str] = field(default_factory=list)


class GrammarMatcher(abc.ABC):
    """Per-request grammar state. Not thread-safe: one request, one matcher."""

    backend_name: str = "abstract"  # the GrammarBackend.name that made it

    @abc.abstractmethod
    def accept_tokens(self, tokens: Sequence[int]) -> bool:
        """Advance by ``tokens``. False if any is rejected; the state is then unchanged."""

    @abc.abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
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

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int] | None = None):
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        eos = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
        for t in eos_token_ids or ():
            if int(t) not in eos:
                eos.append(int(t))
        if not eos:
            raise ValueError("the tokenizer has no eos_token_id; pass eos_token_ids")
        self.eos_token_ids: list[int] = eos

    @abc.abstractmethod
    def compile(self, spec: OutputSpec) -> CompiledGrammar:
        """Compile ``spec``; raise ``GrammarError`` naming the reason and the offending part."""

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

    def only_eos_allowed(self, matcher: GrammarMatcher) -> bool:
        """The matcher's next-token mask allows no token but EOS (one mask fill)."""
        row = allocate_bitmask(1, self.vocab_size)
        matcher.fill_bitmask(row, 0)
        allowed = unpack_bitmask(row, self.vocab_size)[0]
        allowed[[t for t in self.eos_token_ids if t < self.vocab_size]] = False
        return not bool(allowed.any())

    def fill_bitmasks(self, rows_and_matchers: Sequence[tuple[int, GrammarMatcher]], bitmask: torch.Tensor) -> None:
        """Fill several rows. Backends override this with a GIL-free parallel fill."""
        for row, matcher in rows_and_matchers:
            matcher.fill_bitmask(bitmask, row)

    def close(self) -> None:
        """Release thread pools; the backend is unusable afterwards."""
