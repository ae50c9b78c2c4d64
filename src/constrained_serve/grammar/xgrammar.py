"""xgrammar backend: pushdown automaton with precomputed per-state token masks.

xgrammar silently ignores JSON Schema keywords it does not implement (``not``, ``if``,
``uniqueItems``, ``allOf`` merging, remote ``$ref``...), so with ``strict=True`` we refuse
such schemas ourselves before compiling; regexes are brought to Python's meaning or refused
(``xgrammar_gaps.py``). ``strict=False`` accepts, with a warning, what xgrammar only reads
more loosely.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence

import numpy as np
import torch
import xgrammar as xgr

from ..engine.detokenizer import encode_continuation
from ..errors import GrammarError
from ..params import OutputSpec
from .base import CompiledGrammar, GrammarBackend, GrammarMatcher, bitmask_width
from .finite_output import rules_without_finite_text
from .gbnf import gbnf_for_backend
from .tokenizer_data import JsonTokenizer, TokenizerData
from .xgrammar_gaps import unsupported_schema_features, xgrammar_regex
from .xgrammar_rewrite import ebnf_with_string_escapes, rewrite_schema
from .xgrammar_vocab import tokenizer_info

logger = logging.getLogger(__name__)

__all__ = ["XGrammarBackend", "XGrammarMatcher", "tokenizer_info", "unsupported_schema_features"]


class XGrammarMatcher(GrammarMatcher):
    backend_name = "xgrammar"
    __slots__ = ("_m", "_backend", "_finished", "_flags")

    def __init__(self, matcher: xgr.GrammarMatcher, backend: "XGrammarBackend"):
        self._m = matcher
        self._backend = backend
        self._finished: bool | None = None  # is_finished() of the current state, once computed
        self._flags: tuple[bool, bool] | None = None  # _state() of the current state, once read

    def _state(self) -> tuple[bool, bool]:
        """(terminated, completed) of the current state, read from xgrammar once per state: a
        step asks for them six times a row (advance, then fill), ~0.5 us of Python each."""
        if self._flags is None:
            self._flags = (self._m.is_terminated(), self._m.is_completed())
        return self._flags

    @property
    def raw(self) -> xgr.GrammarMatcher:
        return self._m

    def accept_tokens(self, tokens: Sequence[int]) -> bool:
        done = 0
        for t in tokens:
            if not self._m.accept_token(int(t)):
                if done:
                    self._m.rollback(done)  # a rejection leaves the state unchanged
                return False
            done += 1
        if done:
            self._finished = self._flags = None
        return True

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        if self._state()[0]:
            # xgrammar refuses to compute a mask after EOS; allow EOS only, like llguidance.
            bitmask[row] = self._backend.eos_row
        else:
            self._m.fill_next_token_bitmask(torch.from_numpy(bitmask), row)

    def forced_tokens(self) -> list[int]:
        if self._state()[0]:
            return []
        text = self._m.find_jump_forward_string()
        if not text:
            return []
        # Canonical tokens of the forced text as it reads mid-output (a SentencePiece
        # tokenizer would put a "▁" before it); none that read back exactly: force nothing.
        ids = encode_continuation(self._backend.tokenizer, text)
        if not ids:
            return []
        # The last token could merge with what the model writes next ('"a' + 'ge' vs '"age'):
        # keep only the part whose canonical tokenization cannot change.
        ids = ids[:-1]
        accepted = 0
        for t in ids:  # defensive: keep the prefix the grammar really accepts
            if not self._m.accept_token(t):
                break
            accepted += 1
        if accepted:
            self._m.rollback(accepted)
        return ids[:accepted]

    def is_finished(self) -> bool:
        # xgrammar terminates only once EOS is taken; llguidance stops as soon as nothing but
        # EOS may follow. Do as llguidance does, so a closed JSON value ends its request
        # without one more decode step just to sample EOS. The mask check runs only where the
        # text is a complete match (for JSON: at the end), once per state.
        if self._finished is None:
            terminated, completed = self._state()
            self._finished = terminated or (completed and self._backend.only_eos_allowed(self))
        return self._finished

    def can_end(self) -> bool:
        terminated, completed = self._state()
        return not terminated and completed

    def rollback(self, n: int) -> None:
        if n > 0:
            self._m.rollback(n)
            self._finished = self._flags = None


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: TokenizerData, num_threads: int = 1, lazy_masks: bool = True):
        super().__init__(tokenizer)
        if tokenizer.xgrammar_info is None:
            raise ValueError("TokenizerData.xgrammar_info is missing (TokenizerData.with_xgrammar_info)")
        self.width = bitmask_width(self.vocab_size)
        self.tokenizer_info = xgr.TokenizerInfo.deserialize_json(tokenizer.xgrammar_info)
        self.tokenizer = JsonTokenizer(tokenizer.tokenizer_json)  # for encode_continuation
        # The manager keeps its own LRU cache; xgrammar's would grow without bound.
        # lazy_masks: build each parser state's token-mask cache on first use instead of
        # precomputing all of them at compile time. Eager compilation of large real-world
        # schemas takes many seconds (beyond the 10 s compile bound on a busy 2-core box);
        # lazily, compile is milliseconds and the first mask of a new state pays instead.
        self._compiler = xgr.GrammarCompiler(
            self.tokenizer_info,
            max_threads=max(1, num_threads),
            cache_enabled=False,
            enable_dynamic_compilation=lazy_masks,
        )
        self.eos_row = np.zeros(self.width, dtype=np.uint32)  # allows EOS only
        for t in self.eos_token_ids:
            if t < self.vocab_size:
                self.eos_row[t // 32] |= np.uint32(1 << (t % 32))
        self.eos_row = self.eos_row.view(np.int32)

    def compile(self, spec: OutputSpec) -> CompiledGrammar:
        t0 = time.perf_counter()
        warnings: list[str] = []
        if spec.grounding is not None:
            # A grounded field's values are the substrings of the source: llguidance has that
            # lexeme (grounded_lark.py); xgrammar has no substring construction nor a way to put
            # one inside its JSON Schema grammar, and spelling every span out as EBNF rules
            # grows with the source. Refused, never silently ungrounded.
            raise GrammarError(
                "xgrammar cannot compile grounded fields (x-grounded, grounded=True): it has no substring "
                "construction for the source text; use grammar_backend='llguidance' (the default)",
                backend=self.name,
                reason="grounded fields need llguidance",
            )
        if spec.kind == "json_schema":
            schema, notes = rewrite_schema(json.loads(spec.text))  # to JSON Schema's meaning where it can
            warnings = list(dict.fromkeys(unsupported_schema_features(schema) + notes))  # a $ref'd part once
            if warnings:
                msg = "ignores " + ", ".join(warnings)
                if spec.strict:
                    raise self.spec_error(spec, msg, prefix="would approximate the spec (strict=True)")
                logger.warning("xgrammar approximates json_schema spec: %s", msg)
        try:
            regex = None
            if spec.kind == "regex":
                # strict=False: xgrammar's looser reading (ASCII \W, ignored anchors) is accepted
                # and reported, as for a schema keyword it drops; strict=True refuses it here.
                regex = xgrammar_regex(spec.text, spec.strict, warnings)
                if warnings:
                    logger.warning("xgrammar approximates regex spec %r: %s", spec.text, "; ".join(warnings))
            handle = self._compile(spec, regex)
            self._check_finite(spec, handle)
        except GrammarError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError/ValueError with its own message
            raise self.spec_error(spec, str(e).strip()) from e
        return CompiledGrammar(self.name, spec, handle, time.perf_counter() - t0, warnings)

    def load(self, payload: str, spec: OutputSpec) -> CompiledGrammar:
        # Compiling again (milliseconds, masks being lazy) beats shipping the compiled
        # grammar: its serialize_json takes ~1 s and megabytes for an ordinary schema.
        regex = xgrammar_regex(spec.text, spec.strict, []) if spec.kind == "regex" else None
        return CompiledGrammar(self.name, spec, self._compile(spec, regex))

    def _compile(self, spec: OutputSpec, regex: str | None) -> xgr.CompiledGrammar:
        """``regex``: a regex spec's pattern as ``xgrammar_regex`` rewrote it (None otherwise)."""
        c = self._compiler
        if spec.is_json:
            text = json.dumps(rewrite_schema(json.loads(spec.text))[0]) if spec.kind == "json_schema" else spec.text
            grammar = xgr.Grammar.from_json_schema(
                text,
                any_whitespace=spec.whitespace,
                separators=None if spec.whitespace else (",", ":"),
                # strict_mode=True would close every object, also those that say
                # additionalProperties: true or a schema. Objects that say nothing were closed
                # already (make_output_spec, closed_objects.py) unless json_open_objects, so
                # both backends read the same schema the same way.
                strict_mode=False,
            )
            mended = ebnf_with_string_escapes(str(grammar))  # escapes in length-bounded strings
            return c.compile_grammar(xgr.Grammar.from_ebnf(mended) if mended else grammar)
        if spec.kind == "regex":
            return c.compile_regex(regex)
        if spec.kind == "lark":
            return c.compile_lark(spec.text)
        if spec.kind == "ebnf":
            return c.compile_grammar(gbnf_for_backend(spec.text, self.name))
        if spec.kind == "choices":
            items = json.loads(spec.text)
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(x, ensure_ascii=False) for x in items))
        raise GrammarError(f"xgrammar: unsupported output kind {spec.kind!r}", backend=self.name)

    def _check_finite(self, spec: OutputSpec, handle: xgr.CompiledGrammar) -> None:
        """Refuse rules that can never end (see finite_output.py): on them xgrammar's
        jump-forward search never returns and eats memory, taking the engine down."""
        stuck = rules_without_finite_text(str(handle.grammar))
        if not stuck:
            return
        if stuck[0] == "root":
            raise self.spec_error(spec, "the spec matches no finite text (it can never be complete)", prefix="refuses")
        raise self.spec_error(
            spec,
            f"rule(s) {', '.join(stuck[:5])} of its grammar can never end: an output "
            f"that entered one could never be complete",
            prefix="refuses",
        )

    def new_matcher(self, compiled: CompiledGrammar) -> XGrammarMatcher:
        return XGrammarMatcher(xgr.GrammarMatcher(compiled.handle, override_stop_tokens=self.eos_token_ids), self)

    def matches(self, compiled: CompiledGrammar, text: str) -> bool:
        m = self.new_matcher(compiled).raw
        return (not text or m.accept_string(text)) and m.is_completed()
