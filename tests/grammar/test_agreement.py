"""Both backends refuse the same never-ending specs with the same message, point syntax
errors at the right line, and xgrammar reads schemas as JSON Schema does (or refuses them)."""

from __future__ import annotations

import pytest

from constrained_serve.errors import GrammarError
from constrained_serve.grammar import make_output_spec
from constrained_serve.grammar.finite_specs import never_ending_parts

NEVER_ENDING = [
    ({"schema": {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}}, "matches no finite text"),
    (
        {
            "schema": {
                "type": "object",
                "required": ["n"],
                "properties": {"n": {"$ref": "#/$defs/node"}},
                "$defs": {
                    "node": {"type": "object", "required": ["next"], "properties": {"next": {"$ref": "#/$defs/node"}}}
                },
            }
        },
        "matches no finite text",
    ),
    (
        {
            "schema": {
                "type": "object",
                "properties": {"a": {"$ref": "#/$defs/l"}},
                "$defs": {"l": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/l"}}},
            }
        },
        "#/$defs/l can never end",
    ),
    ({"grammar": 'start: a\na: "x" a\n'}, "matches no finite text"),
    ({"grammar": 'start: "y" | b\nb: "x" b\n'}, "rule(s) b can never end"),
    ({"grammar": 'root ::= "x" root', "grammar_syntax": "ebnf"}, "matches no finite text"),
]


@pytest.mark.parametrize("kwargs,reason", NEVER_ENDING)
def test_never_ending_specs_are_refused_alike(manager, backend, kwargs, reason):
    with pytest.raises(GrammarError, match="can never") as e:
        manager.compile(make_output_spec(**kwargs), backend)
    assert reason in str(e.value) and str(e.value).startswith(f"{backend} refuses"), str(e.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"schema": {"type": "object", "properties": {"a": {"$ref": "#"}}}},  # optional: {} ends it
        {
            "schema": {
                "type": "object",
                "properties": {"a": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
                "required": ["a"],
            }
        },
        {"schema": {"$defs": {"t": {"type": "array", "items": {"$ref": "#/$defs/t"}}}, "$ref": "#/$defs/t"}},
        {"grammar": 'start: a\na: "x" a | "y"\n'},
        {"grammar": 'start: item+\nitem: "(" item* ")"\n'},
    ],
)
def test_recursive_specs_that_can_end_compile(manager, backend, kwargs):
    assert not never_ending_parts(make_output_spec(**kwargs))
    manager.compile(make_output_spec(**kwargs), backend)


@pytest.mark.parametrize(
    "grammar,line,col",
    [
        ("start: A B\nA: /a+\n", 2, 4),
        ('start: A B\nA: "a\n', 2, 4),
        ("\n\n\nstart: A B\nA: /a+\n", 5, 4),
    ],
)
def test_lark_syntax_errors_point_at_their_line(manager, backend, grammar, line, col):
    with pytest.raises(GrammarError) as e:
        manager.compile(make_output_spec(grammar=grammar), backend)
    assert f"line {line}, column {col}" in str(e.value), str(e.value)


# (schema, texts JSON Schema accepts, texts it refuses): xgrammar 0.2.9 read each otherwise.
XGRAMMAR_READINGS = [
    ({"type": "string", "pattern": "^pkg:"}, ['"pkg:serializer1"', '"pkg:"'], ['"xpkg:"', '"pk"']),
    ({"type": "string", "pattern": "b$|^c"}, ['"xab"', '"cx"'], ['"xc"']),
    ({"type": "string", "pattern": "a+"}, ['"xaay"'], ['"b"']),
    ({"type": "string", "enum": ["a", 1]}, ['"a"'], ["1"]),
    ({"type": "string", "maxLength": 5}, ['"a\\"b"', '"a\\nb"'], ['"abcdef"', '"a\tb"']),
    ({"type": "string", "minLength": 2}, ['"a\\"b"'], ['"a"']),
    ({"items": {"type": "integer"}}, ['"x"', "[1]", "{}", "5"], ['["a"]']),
    ({"properties": {"a": {"type": "integer"}}}, ['"x"', '{"a":1}', "5"], ['{"a":"x"}']),
    ({"minLength": 3}, ['"abc"', "5", "null"], ['"ab"']),  # string/number keywords without "type"
    ({"minimum": 3}, ["3", '"x"'], ["2"]),
    ({"enum": [1, "a"], "minLength": 3}, ["1"], ['"a"']),  # next to an enum xgrammar checked only the enum
    (
        {"type": "object", "properties": {"k": {"type": "object", "enum": ["A"]}}, "additionalProperties": False},
        ["{}"],
        ['{"k":"A"}'],
    ),  # a property that can hold no value: absent
]


@pytest.mark.parametrize("schema,good,bad", XGRAMMAR_READINGS)
def test_both_backends_read_schemas_as_json_schema_does(manager, backend, schema, good, bad):
    compiled = manager.compile(make_output_spec(schema=schema), backend)
    for text in good:
        assert manager.matches(compiled, text), (backend, text)
    for text in bad:
        assert not manager.matches(compiled, text), (backend, text)


def test_xgrammar_refuses_pattern_next_to_format_under_strict(manager):
    schema = {"type": "string", "format": "uri", "pattern": "^(https|file)://"}
    with pytest.raises(GrammarError, match="pattern \\(ignored next to format\\)"):
        manager.compile(make_output_spec(schema=schema), "xgrammar")
    compiled = manager.compile(make_output_spec(schema=schema), "llguidance")
    assert manager.matches(compiled, '"https://x.org"') and not manager.matches(compiled, '"ftp://x.org"')


def test_an_enum_no_value_of_which_fits_matches_nothing(manager, backend):
    with pytest.raises(GrammarError, match="Unsatisfiable schema"):
        manager.compile(make_output_spec(schema={"type": "string", "enum": [1, 2]}), backend)
