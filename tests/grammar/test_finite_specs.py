"""Specs that can never be complete (finite_specs.py) are refused alike by both backends, with
the same message; recursive specs that can end compile."""

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
