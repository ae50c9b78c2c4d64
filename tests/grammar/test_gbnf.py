"""GBNF character escapes (gbnf.py) mean on both backends what they mean in llama.cpp."""

from __future__ import annotations

import pytest

from constrained_serve.errors import GrammarError
from constrained_serve.grammar import make_output_spec


@pytest.mark.parametrize(
    "grammar, text, other",
    [
        ('root ::= "\\x41B"', "AB", "Л"),  # \x takes exactly two hex digits (xgrammar read "\x41B" as U+041B)
        ('root ::= "caf\\u00e9" [\\u0041-\\u005A]', "caféQ", "cafeQ"),  # \u, which llguidance refused
        ('root ::= "\\U0001F600" [\\x5D\\x2D]', "😀-", "😀x"),
        ('root ::= "\\x22" [^\\x00-\\x1F"]+ "\\x22"  # a comment with "\\x41B"', '"ok"', '"o"k"'),
        ("root ::= [\\x2D\\x30-\\x39]+", "-12", "a"),  # an escaped "-" next to a hex-digit escape
        ('root ::= "\\x01\\x41" [\\u002Df]', "\x01A-", "\x1a-"),
    ],
)
def test_gbnf_escapes_mean_what_llama_cpp_means(manager, backend, grammar, text, other):
    c = manager.compile(make_output_spec(grammar=grammar, grammar_syntax="gbnf"), backend)
    assert manager.matches(c, text) and not manager.matches(c, other)


def test_gbnf_escape_that_is_no_character_is_a_grammar_error(manager, backend):
    for bad in ('root ::= "\\UFFFFFFFF"', 'root ::= "\\uD800"'):
        with pytest.raises(GrammarError, match="not a Unicode character"):
            manager.compile(make_output_spec(grammar=bad, grammar_syntax="gbnf"), backend)
