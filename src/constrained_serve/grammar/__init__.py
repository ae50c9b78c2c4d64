"""Grammar subsystem: output specs, two engines behind one interface, and the manager."""
from __future__ import annotations

from .base import CompiledGrammar, GrammarBackend, GrammarMatcher, bitmask_width
from .manager import BACKENDS, GrammarManager
from .spec import canonical_json, make_output_spec, parse_output

__all__ = [
    "BACKENDS", "CompiledGrammar", "GrammarBackend", "GrammarManager", "GrammarMatcher",
    "bitmask_width", "canonical_json", "make_output_spec", "parse_output",
]
