"""llguidance backend (the default): Earley parser + lazy lexer, masks computed on demand.

Compilation builds one template ``LLMatcher`` per grammar (that is where llguidance parses
the grammar and reports errors and warnings); each request gets a ``deep_copy`` of it,
which is much cheaper than re-parsing the grammar. The payload that rebuilds the template in
another process is llguidance's own grammar text (the JSON Schema or Lark already converted).
"""

from __future__ import annotations

import json
import logging
import re
import time
import weakref
from collections.abc import Sequence
from typing import NamedTuple

import llguidance
import numpy as np
from llguidance import LLMatcher, LLTokenizer

from ..errors import GrammarError
from ..params import OutputSpec
from .base import CompiledGrammar, GrammarBackend, GrammarMatcher, allowed_tokens, bitmask_width
from .gbnf import gbnf_for_backend
from .tokenizer_data import TokenizerData

logger = logging.getLogger(__name__)

__all__ = ["LLGuidanceBackend", "LLGuidanceMatcher"]

# llguidance stops one mask computation after this much lexer work, with "lexer error: too
# many expressions constructed". Its default (200k, about 14 ms) refused, mid-decoding, a
# schema whose first mask inside a string builds many lexer states at once (anyOf branches
# whose string has maxLength and a long alternation pattern: three such branches need
# between 200k and 500k). The engine's mask deadline (grammar_mask_timeout_s, 0.5 s by
# default) bounds the time anyway, so the fuel allows about 140 ms: the state is built once
# and later masks reuse it.
STEP_LEXER_FUEL = 2_000_000


# The submit-time probe (LLGuidanceBackend._probe): how far it walks, and how many allowed
# tokens it looks at to tell fixed bytes from a choice.
_PROBE_STEPS = 32
_PROBE_NARROW = 16


def _limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(step_lexer_fuel=STEP_LEXER_FUEL)


class LLGuidanceMatcher(GrammarMatcher):
    backend_name = "llguidance"
    __slots__ = ("_m", "_width", "_eos", "_ended", "_eos_uncounted")

    def __init__(self, matcher: LLMatcher, width: int, eos: frozenset[int]):
        self._m = matcher
        self._width = width
        self._eos = eos
        # llguidance still reports "accepting" after EOS; track it so can_end() means
        # "EOS allowed now" for both backends.
        self._ended = False
        self._eos_uncounted = False  # EOS taken in the stopped state is not in llguidance's history

    @property
    def raw(self) -> LLMatcher:
        return self._m

    def accept_tokens(self, tokens: Sequence[int]) -> bool:
        tokens = list(tokens)
        if not tokens:
            return True
        if self._m.is_error():
            return False
        if self._ended:
            return False  # nothing follows EOS
        # try_consume_tokens stops at the first rejected token without entering the error
        # state; undo the accepted prefix so a rejection leaves the state unchanged.
        n = self._m.try_consume_tokens(tokens)
        uncounted = False
        if n == len(tokens) - 1 and tokens[-1] in self._eos and self._m.is_stopped():
            # A stopped matcher (only EOS left) reports EOS as not consumable by
            # try_consume_tokens, yet consume_token takes it without adding it to the
            # token history (so rollback must not count it).
            if self._m.consume_token(tokens[-1]):
                n, uncounted = n + 1, True
        if n == len(tokens) and not self._m.is_error():
            self._ended = tokens[-1] in self._eos
            self._eos_uncounted = uncounted
            return True
        if n and not self._m.is_error():
            self._m.rollback(n)
        return False

    def accept_sampled(self, token: int) -> bool:
        if self._ended or token in self._eos:  # EOS has its special cases: accept_tokens
            return self.accept_tokens([token])
        # consume_token, which enters the error state on a refusal, costs 1.2 us where
        # try_consume_tokens costs 1.9 (256 rows a step); the mask allowed the token, so a
        # refusal is the backend's own failure, and error() reports it.
        return self._m.consume_token(token)

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        _fill_row(self._m, bitmask, row, self._width)

    def forced_tokens(self) -> list[int]:
        if self._m.is_stopped():
            return []
        # llguidance returns the canonical tokenization of the forced bytes and already
        # holds back a final token that a longer token could extend.
        return list(self._m.compute_ff_tokens())

    def is_finished(self) -> bool:
        # llguidance also reports "stopped" in its error state (a parser limit hit mid-output).
        return self._m.is_stopped() and not self._m.is_error()

    def can_end(self) -> bool:
        return not self._ended and not self._m.is_error() and self._m.is_accepting()

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        if self._ended:  # EOS can only be the last token, so any rollback removes it
            self._ended = False
            if self._eos_uncounted:
                self._eos_uncounted = False
                n -= 1
        if n and not self._m.rollback(n):
            raise ValueError(f"llguidance: cannot roll back {n} tokens: {self._m.get_error()}")

    def error(self) -> str | None:
        if not self._m.is_error():
            return None
        # The first line is the reason; the rest dumps the parser state and the whole grammar.
        full = self._m.get_error()
        logger.debug("llguidance matcher error: %s", full)
        reason = full.split("\n", 1)[0]
        # NoExtension*: nothing can follow, i.e. a dead end in the spec, not a failure of
        # llguidance; the engine's dead-end check explains those in the spec's terms.
        return None if reason.startswith("NoExtension") else reason


def _located(spec: OutputSpec, error: str) -> str:
    """llguidance's Lark lexer reads an unterminated string or regex to the end of the text
    and reports that place ("4(1): lexer error" for a 2-line grammar); lark's own grammar
    parser reports where it starts. Other errors keep llguidance's (right) position."""
    if spec.kind != "lark" or "lexer error" not in error.split("\n", 1)[0]:
        return error
    from lark.exceptions import GrammarError as LarkGrammarError
    from lark.load_grammar import load_grammar

    try:
        load_grammar(spec.text, "<spec>", [], False)
    except LarkGrammarError as e:
        m = re.search(r"line (\d+) column (\d+)", str(e))
        if m:
            lines = spec.text.splitlines()
            line = int(m.group(1))
            shown = lines[line - 1] if 0 < line <= len(lines) else ""
            return (
                f"line {m.group(1)}, column {m.group(2)}: lexer error (an unterminated string or regular "
                f"expression?)\n{shown}\n{' ' * (int(m.group(2)) - 1)}^"
            )
    except Exception:  # noqa: BLE001 - lark reads it otherwise: keep llguidance's message
        pass
    return error


class _CheckedBitmask(NamedTuple):
    """A bitmask ``_fill_row`` checked, and where its rows lie in memory."""

    array: weakref.ref  # a freed array's id, reused by another, is never mistaken for it
    width: int
    address: int
    row_bytes: int
    rows: int


_last_checked: _CheckedBitmask | None = None


def _fill_row(matcher: LLMatcher, bitmask: np.ndarray, row: int, width: int) -> None:
    """What llguidance.numpy.fill_next_token_bitmask does: llguidance writes ``bitmask[row]``
    (contiguous int32 [rows, width]) in place. Checking the array and taking
    ``bitmask[row].ctypes.data`` cost ~1.2 us a fill, 256 fills a step in a mask worker, which
    always fills the same shared bitmask: so the bitmask last filled is checked once, and its
    rows' addresses are computed from its own."""
    global _last_checked
    last = _last_checked
    # The shape too: an in-place ndarray.resize would move the memory.
    if last is None or last.array() is not bitmask or last.width != width or last.rows != bitmask.shape[0]:
        _check_bitmask(bitmask, width)
        last = _last_checked = _CheckedBitmask(
            weakref.ref(bitmask), width, bitmask.ctypes.data, bitmask.strides[0], bitmask.shape[0]
        )
    if not 0 <= row < last.rows:  # llguidance writes where it is told: never past the array
        raise IndexError(f"bitmask row {row} is out of range for {last.rows} rows")
    matcher.unsafe_compute_mask_ptr(last.address + row * last.row_bytes, last.row_bytes)


def _check_bitmask(bitmask: np.ndarray, width: int) -> None:
    if bitmask.dtype != np.int32 or bitmask.ndim != 2 or bitmask.shape[1] != width:
        raise ValueError(f"bitmask must be int32 [rows, {width}], got {bitmask.dtype} {bitmask.shape}")
    if not bitmask.flags.c_contiguous or not bitmask.flags.writeable:
        raise ValueError("bitmask must be a contiguous, writeable array")


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(self, tokenizer: TokenizerData):
        super().__init__(tokenizer)
        self.width = bitmask_width(self.vocab_size)
        # n_vocab = the model width: ids past the tokenizer's vocabulary are never allowed.
        # (llguidance.hf.from_tokenizer does the same from a Hugging Face tokenizer.)
        self.ll_tokenizer = LLTokenizer(tokenizer.tokenizer_json, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
        self._eos = frozenset(self.eos_token_ids)

    # -- compile -------------------------------------------------------------------------
    def grammar_text(self, spec: OutputSpec) -> str:
        """The llguidance grammar (JSON) for ``spec``; raises GrammarError on conversion errors."""
        if spec.grounding is not None:  # grounded string fields: the schema as Lark around them
            from .grounded_lark import grounded_grammar

            try:
                return LLMatcher.grammar_from_lark(grounded_grammar(spec))
            except ValueError as e:
                raise self.spec_error(spec, str(e)) from e
        if spec.is_json:
            options = {
                "whitespace_flexible": spec.whitespace,
                # lenient ignores unimplemented keywords (with a warning) instead of failing;
                # coerce_one_of approximates oneOf by anyOf where branches may overlap.
                "lenient": not spec.strict,
                "coerce_one_of": not spec.strict,
            }
            if not spec.whitespace:
                options.update(item_separator=",", key_separator=":")
            try:
                return LLMatcher.grammar_from_json_schema(spec.text, defaults=options)
            except ValueError as e:
                raise self.spec_error(spec, str(e)) from e
        if spec.kind == "regex":
            return LLMatcher.grammar_from_regex(spec.text)
        if spec.kind == "lark":
            return LLMatcher.grammar_from_lark(spec.text)
        if spec.kind == "choices":
            # One lexeme (the lexer's automaton) rather than one parser alternative per choice:
            # Earley rows hold at most 2000 items, and the lexer is faster for long lists.
            lark = "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in json.loads(spec.text))
            return LLMatcher.grammar_from_lark(lark)
        if spec.kind == "ebnf":
            try:
                return llguidance.grammar_from("gbnf", gbnf_for_backend(spec.text, self.name))
            except ValueError as e:
                raise self.spec_error(spec, str(e)) from e
        raise GrammarError(f"llguidance: unsupported output kind {spec.kind!r}", backend=self.name)

    def compile(self, spec: OutputSpec) -> CompiledGrammar:
        t0 = time.perf_counter()
        grammar = self.grammar_text(spec)
        template = LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=_limits())
        if template.is_error():
            raise self.spec_error(spec, _located(spec, template.get_error()))
        self._probe(spec, template)
        warnings = list(template.get_grammar_warnings())
        if spec.is_json and not spec.strict and '"oneOf"' in spec.text:
            # llguidance coerces silently; say so, as for every other approximation
            warnings.append("oneOf may be approximated by anyOf (coerce_one_of)")
        if warnings:
            if spec.strict:
                # The engine would accept the grammar but silently approximate part of it.
                raise self.spec_error(spec, "; ".join(warnings), prefix="would approximate the spec (strict=True)")
            logger.warning("llguidance approximates %s spec: %s", spec.kind, "; ".join(warnings))
        return CompiledGrammar(self.name, spec, template, time.perf_counter() - t0, warnings, payload=grammar)

    def _probe(self, spec: OutputSpec, template: LLMatcher) -> None:
        """Compute, at submit, the masks a request needs first: llguidance builds its lexer
        lazily, so a spec it cannot lex (past the fuel above) would otherwise fail only when
        a request reaches that place. The walk follows the spec's fixed start (forced tokens,
        and masks whose few tokens all spell starts of the same fixed bytes: the longest is
        taken) to the first real choice, and computes that mask too. Deeper places are not
        walked: a spec can still fail there, mid-decoding, as the request's own error."""
        m = template.deep_copy()
        row = np.zeros((1, self.width), dtype=np.int32)
        for _ in range(_PROBE_STEPS):
            _fill_row(m, row, 0, self.width)
            if m.is_error():
                reason = m.get_error().split("\n", 1)[0]
                if reason.startswith("NoExtension"):  # a dead end: the engine explains those
                    return
                raise self.spec_error(spec, reason, prefix="cannot compute the first token masks of")
            forced = list(m.compute_ff_tokens())
            if not forced:  # fixed bytes still, if every allowed token spells a start of them
                ids = [int(t) for t in np.flatnonzero(allowed_tokens(row[0], self.vocab_size)) if t not in self._eos]
                if not ids or len(ids) > _PROBE_NARROW:
                    return  # the first real choice (or the end): its mask was computed
                spelled = [self.ll_tokenizer.decode_bytes([t]) for t in ids]
                longest = max(spelled, key=len)
                if not all(longest.startswith(b) for b in spelled):
                    return  # a choice between a few tokens
                forced = [ids[spelled.index(longest)]]
            if not m.consume_tokens(forced):
                return

    def load(self, payload: str, spec: OutputSpec) -> CompiledGrammar:
        template = LLMatcher(self.ll_tokenizer, payload, log_level=0, limits=_limits())
        if template.is_error():
            raise self.spec_error(spec, template.get_error())
        return CompiledGrammar(self.name, spec, template, payload=payload)

    # -- matchers ------------------------------------------------------------------------
    def new_matcher(self, compiled: CompiledGrammar) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(compiled.handle.deep_copy(), self.width, self._eos)

    def matches(self, compiled: CompiledGrammar, text: str) -> bool:
        # llguidance matches bytes, so any tokenization of the text will do; tokenize_str
        # spells it exactly (no prefix space, unlike some HF tokenizers' encode).
        m = self.new_matcher(compiled).raw
        ids = self.ll_tokenizer.tokenize_str(text)
        return m.try_consume_tokens(ids) == len(ids) and not m.is_error() and m.is_accepting()
