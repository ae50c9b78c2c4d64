"""Issue #41, Python API side of the spec: deep schemas, bad regexes, ASCII classes, two specs."""

from __future__ import annotations

import json

import pytest

from constrained_serve.errors import GrammarError
from constrained_serve.grammar.ascii_classes import ascii_classes, ascii_schema_patterns
from constrained_serve.grammar.spec import MAX_SCHEMA_DEPTH, make_output_spec

from ..helpers import deep_schema as _deep


@pytest.mark.parametrize("form", ["dict", "text"])
def test_a_schema_nested_1000_deep_is_a_grammar_error_not_a_recursion_error(form):
    schema = _deep(1000)
    with pytest.raises(GrammarError, match="nests deeper"):
        make_output_spec(schema=schema if form == "dict" else _deep_text(1000))
    make_output_spec(schema=_deep(MAX_SCHEMA_DEPTH // 2 - 2))  # a deep but sane one is fine


def _deep_text(n: int) -> str:
    return '{"type":"object","properties":{"a":' * n + '{"type":"object"}' + "}}" * n


def test_python_invalid_regex_is_refused_as_invalid():
    with pytest.raises(GrammarError, match="not a valid regular expression: multiple repeat"):
        make_output_spec(regex="a{1000}{1000}")
    with pytest.raises(GrammarError, match="not a valid regular expression"):
        make_output_spec(regex="(")
    assert make_output_spec(regex=r"\p{L}+").text == r"\p{L}+"  # Rust-only syntax: the backend decides


@pytest.mark.parametrize(
    "pattern, ascii",
    [
        (r"\d{4}-\d{2}-\d{2}", "[0-9]{4}-[0-9]{2}-[0-9]{2}"),
        (r"[\d.]+", "[0-9.]+"),
        (r"[^\w\s]", r"[^0-9A-Za-z_\s]"),
        (r"\D\W", "[^0-9][^0-9A-Za-z_]"),
        # \D / \W in a class: the one flat class meant, read alike by Python and Rust
        (r"[a\D]+", "[^0-9]+"),
        (r"[5\D]", "[^0-46-9]"),
        (r"[^a\W]", "[0-9A-Z_b-z]"),
        (r"[^\D]", "[0-9]"),
        (r"[\d\D]", r"[\s\S]"),
        (r"\\d", r"\\d"),  # an escaped backslash, then d
        (r"\p{Nd}", r"\p{Nd}"),
        (r"\s+", r"\s+"),
    ],
)
def test_ascii_classes(pattern, ascii):
    assert ascii_classes(pattern) == ascii


def test_regex_and_schema_patterns_are_ascii_by_default_unicode_on_request():
    assert make_output_spec(regex=r"\d+").text == "[0-9]+"
    assert make_output_spec(regex=r"\d+", unicode_classes=True).text == r"\d+"
    spec = make_output_spec(
        schema={
            "type": "object",
            "properties": {"d": {"type": "string", "pattern": r"^\d+$"}, "enum": {"enum": [r"\d"]}},
            "patternProperties": {r"^\w+$": {"type": "string"}},
        }
    )
    text = json.loads(spec.text)
    assert text["properties"]["d"]["pattern"] == "^[0-9]+$"
    assert text["properties"]["enum"]["enum"] == [r"\d"]  # data, not a pattern
    assert list(text["patternProperties"]) == ["^[0-9A-Za-z_]+$"]
    assert list(text["properties"]) == ["d", "enum"]  # property order kept


def test_ascii_schema_patterns_is_iterative():
    assert ascii_schema_patterns(_deep(5000))["type"] == "object"


def test_two_specs_in_one_call_are_a_usage_error():
    with pytest.raises(TypeError, match="at most one output constraint"):
        make_output_spec(schema={"type": "integer"}, regex="a")


@pytest.mark.parametrize("pattern", [r"(?i)[^a\W]+", r"k(?i:[^ab\W])", r"(?mi)[a\D]x", r"[^Z\W]"], ids=str)
def test_flat_classes_keep_their_meaning_under_a_case_insensitive_flag(pattern):
    """A class holding \\W or \\D is flattened; under (?i) the flag folds the flat class too,
    so both cases of its letters are left out (every printable ASCII character checked)."""
    import re
    import string

    from constrained_serve.grammar.ascii_classes import ascii_classes

    flat = ascii_classes(pattern)
    assert "\\W" not in flat and "\\D" not in flat
    for text in [*string.printable, "kb", "ka", "kA", "Bx", "1x"]:
        assert bool(re.fullmatch(pattern, text, re.ASCII)) == bool(re.fullmatch(flat, text)), (text, flat)
