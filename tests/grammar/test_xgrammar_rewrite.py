"""Schemas xgrammar 0.2.9 read otherwise than JSON Schema does, rewritten before they reach it
(xgrammar_rewrite.py) so that both backends read them as JSON Schema does; llguidance runs the
same cases as the cross-check."""

from __future__ import annotations

import pytest

from constrained_serve.errors import GrammarError
from constrained_serve.grammar import make_output_spec

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


def test_an_enum_no_value_of_which_fits_matches_nothing(manager, backend):
    with pytest.raises(GrammarError, match="Unsatisfiable schema"):
        manager.compile(make_output_spec(schema={"type": "string", "enum": [1, 2]}), backend)
