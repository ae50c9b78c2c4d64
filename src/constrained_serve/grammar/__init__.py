"""Grammar subsystem: output specs, two engines behind one interface, and the manager.

Imports are lazy: grammar worker processes import ``constrained_serve.grammar.worker``, and
must not pay for torch (which the manager needs) on the way."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CompiledGrammar": ".base",
    "GrammarBackend": ".base",
    "GrammarMatcher": ".base",
    "bitmask_width": ".base",
    "BACKENDS": ".manager",
    "GrammarManager": ".manager",
    "MatcherHandle": ".manager",
    "canonical_json": ".spec",
    "make_output_spec": ".spec",
    "parse_output": ".output_check",
    "TokenizerData": ".tokenizer_data",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value
