"""What xgrammar would silently drop or read otherwise than JSON Schema and Python do
(xgrammar_gaps.py): refused under strict=True, accepted with a warning under strict=False,
or brought to Python's meaning."""

from __future__ import annotations

import logging

import pytest

from constrained_serve.errors import GrammarError
from constrained_serve.grammar import make_output_spec


def _discriminated_union(second_kind: str, typed: bool = True) -> dict:
    def branch(kind: str, field: str) -> dict:
        b = {
            "properties": {"kind": {"const": kind}, field: {"type": "integer"}},
            "required": ["kind", field],
            "additionalProperties": False,
        }
        return {"type": "object", **b} if typed else b

    return {
        "$defs": {"Cat": branch("cat", "lives"), "Dog": branch(second_kind, "good")},
        "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
    }


def test_discriminated_one_of_is_exact_for_the_xgrammar_check():
    # Pydantic's discriminated unions: object branches told apart by a required constant.
    from constrained_serve.grammar.xgrammar import unsupported_schema_features

    assert unsupported_schema_features(_discriminated_union("dog")) == []
    # The same constant twice, or branches that are not typed objects, may overlap.
    assert unsupported_schema_features(_discriminated_union("cat")) == ["#/oneOf (treated as anyOf)"]
    assert unsupported_schema_features(_discriminated_union("dog", typed=False)) == ["#/oneOf (treated as anyOf)"]


# Schemas whose keyword xgrammar (0.2.9) drops, with a text it then accepts that the schema
# refuses. strict=False must show the approximation is real: if xgrammar ever enforces one,
# this fails and the check can go.
XGRAMMAR_DROPS = [
    ({"type": "object", "required": ["zz"]}, "{}"),  # a required name not in properties
    ({"type": "object", "properties": {"o": {"type": "object", "required": ["k"]}}, "required": ["o"]}, '{"o":{}}'),
    ({"anyOf": [{"type": "number"}, {"type": "null"}], "minimum": 0}, "-1"),
    # patternProperties next to properties is ignored (JSONSchemaBench wp_91 accepted "k":-2)
    (
        {
            "type": "object",
            "properties": {"b": {"type": "string"}},
            "patternProperties": {".*": {"type": "string"}},
            "required": ["b"],
        },
        '{"b":"a","k":-2}',
    ),
]


@pytest.mark.parametrize("schema, text", XGRAMMAR_DROPS)
def test_xgrammar_strict_refuses_keywords_it_would_drop(manager, schema, text):
    import json

    import jsonschema

    with pytest.raises(GrammarError, match="strict=True"):
        manager.compile(make_output_spec(schema=schema), "xgrammar")
    loose = manager.compile(make_output_spec(schema=schema, strict=False), "xgrammar")
    assert manager.matches(loose, text)
    assert not jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "enum": ["abc", "xyz"], "minLength": 3},  # every enum value obeys
        {"type": "array", "items": {"type": "integer"}, "required": ["0"]},  # required only binds objects
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    ],
)
def test_xgrammar_strict_keeps_exact_schemas(manager, schema):
    assert not manager.compile(make_output_spec(schema=schema), "xgrammar").warnings


def test_xgrammar_regex_means_what_python_means(manager):
    from constrained_serve.grammar.xgrammar_gaps import xgrammar_regex

    # "." excludes the newline (xgrammar's own "." does not); classes and escapes are kept.
    assert xgrammar_regex(r"^a.c[.]\.[]x.][^].]$") == r"^a[^\n]c[.]\.[]x.][^].]$"
    c = manager.compile(make_output_spec(regex="a.c"), "xgrammar")
    assert manager.matches(c, "abc") and not manager.matches(c, "a\nc")
    # Anchors at the edges of the text are exact (xgrammar ignores them); \A and \Z, which it
    # read as letters, become ^ and $.
    for rx, yes, no in (
        (r"\Aab\Z", "ab", "AabZ"),
        ("^a$|^b$", "b", "ab"),
        ("(^a|^b)c", "bc", "c"),
        (r"[\^x]a", "^a", "1a"),
        (r"[\^]a", "^a", "1a"),
        ("(?:^x)?y{1,3}", "xyy", "xxy"),
    ):
        c = manager.compile(make_output_spec(regex=rx), "xgrammar")
        assert manager.matches(c, yes) and not manager.matches(c, no), rx
    # An anchor inside the text (a^b matched "ab"), \G and inline flags are refused; so are,
    # with unicode_classes=True (Python's Unicode \w and \d), \W, \D and negated classes
    # with \w/\d, which xgrammar reads as ASCII complements ("é").
    for rx, unicode in (
        ("a^b", False),
        ("a$b", False),
        ("(a$|b)c", False),
        (r"a\G", False),
        ("(?s:a.b)", False),
        ("(^a)+", False),
        ("(?:^a|b)*", False),
        (r"\W", True),
        (r"a\D+", True),
        (r"[^\w]", True),
        (r"[x\W]", True),
        (r"[^a\d]", True),
    ):
        with pytest.raises(GrammarError, match="as Python reads it"):
            manager.compile(make_output_spec(regex=rx, unicode_classes=unicode), "xgrammar")


@pytest.mark.parametrize(
    "rx, yes, no",
    [
        (r"\W+", ["é", "٣", "!"], ["a", "_", "5"]),
        (r"a\D+", ["a٣", "ab"], ["a5"]),
        (r"[^\w]", ["é", " "], ["a", "0"]),
        (r"[x\W]", ["x", "é"], ["y", "5"]),
        (r"[^a\d]", ["b", "٣"], ["a", "5"]),
        (r"[^a\W]+", ["b5_Z"], ["a", "é"]),
    ],
)
def test_ascii_classes_are_read_alike_by_both_backends_and_python(manager, rx, yes, no):
    r"""regex= reads \w and \d as ASCII by default (ascii_classes.py): xgrammar's reading, so
    what it refused under unicode_classes=True compiles, and both backends and Python's re
    (the final check) take and refuse the same texts."""
    import re

    from constrained_serve.grammar import parse_output

    spec = make_output_spec(regex=rx)
    for backend in ("xgrammar", "llguidance"):
        c = manager.compile(spec, backend)
        assert not c.warnings
        for text in yes:
            assert manager.matches(c, text) and re.fullmatch(spec.text, text), (backend, rx, text)
            assert parse_output(spec, text)[1] == text
        for text in no:
            assert not manager.matches(c, text) and not re.fullmatch(spec.text, text), (backend, rx, text)


@pytest.mark.parametrize(
    "rx, text",
    [
        (r"\W+", "é"),
        (r"a\D", "a٣"),
        (r"[^\w]", "é"),
        ("a^b", "ab"),
        ("(^a)+", "aa"),
        ("(a$|b)c", "ac"),
    ],
)
def test_xgrammar_strict_false_accepts_its_looser_regex_reading(manager, caplog, rx, text):
    """What xgrammar reads only more loosely than Python (ASCII \\W where unicode_classes=True
    asks for Python's Unicode one; anchors it ignores) is an error under strict=True and, under
    strict=False, compiles with a warning, as a schema keyword it drops does. The text shows
    the approximation is real: Python refuses it."""
    import re

    with pytest.raises(GrammarError, match="strict=False accepts"):
        manager.compile(make_output_spec(regex=rx, unicode_classes=True), "xgrammar")
    with caplog.at_level(logging.WARNING, logger="constrained_serve.grammar.xgrammar"):
        loose = manager.compile(make_output_spec(regex=rx, strict=False, unicode_classes=True), "xgrammar")
    assert loose.warnings and "xgrammar approximates regex spec" in caplog.text
    assert manager.matches(loose, text) and re.fullmatch(rx, text) is None


@pytest.mark.parametrize("rx", [r"a\G", "(?s:a.b)", r"[\^-x]"])
def test_xgrammar_refuses_regexes_it_would_read_otherwise_even_when_not_strict(manager, rx):
    with pytest.raises(GrammarError, match="as Python reads it"):
        manager.compile(make_output_spec(regex=rx, strict=False), "xgrammar")


def test_xgrammar_refuses_scoped_inline_flags():
    from constrained_serve.errors import GrammarError
    from constrained_serve.grammar.xgrammar_gaps import xgrammar_regex

    with pytest.raises(GrammarError, match="no inline flags"):
        xgrammar_regex("(?s-m:x)", strict=True)


def test_xgrammar_refuses_pattern_next_to_format_under_strict(manager):
    schema = {"type": "string", "format": "uri", "pattern": "^(https|file)://"}
    with pytest.raises(GrammarError, match="pattern \\(ignored next to format\\)"):
        manager.compile(make_output_spec(schema=schema), "xgrammar")
    compiled = manager.compile(make_output_spec(schema=schema), "llguidance")
    assert manager.matches(compiled, '"https://x.org"') and not manager.matches(compiled, '"ftp://x.org"')
