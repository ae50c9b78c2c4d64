"""Output specs (spec.py): every way to ask for one (a JSON Schema as a dict or text, a
Pydantic or other Python type, response_format, a regex, Lark or GBNF, choices) becomes one
canonical OutputSpec; bad arguments are named."""

from __future__ import annotations

import dataclasses
import json

import pytest

from constrained_serve.errors import GrammarError, OutputValidationError
from constrained_serve.grammar import make_output_spec, parse_output

from .grammar_test_types import Person, Point


@dataclasses.dataclass
class Box:
    w: float
    h: float


def test_none_and_text():
    assert make_output_spec() is None
    assert make_output_spec(response_format={"type": "text"}) is None


def test_schema_forms_share_canonical_text():
    schema = {"type": "object", "required": ["a"], "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    s1 = make_output_spec(schema=schema)
    s2 = make_output_spec(schema=json.dumps(schema, indent=2))
    s3 = make_output_spec(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert s1 == s2 == s3 and s1.kind == "json_schema"
    # keys sorted, but the property order (b before a) is kept: it is part of the grammar
    # (and the object closed: it says nothing about additionalProperties)
    assert s1.text == (
        '{"additionalProperties":false,"properties":{"b":{"type":"integer"},"a":{"type":"string"}},'
        '"required":["a"],"type":"object"}'
    )


def test_property_order_is_kept_under_any_name():
    """Every properties map keeps its order, also inside a $defs entry (or a property)
    that happens to be called "properties"; other name maps are sorted."""
    inner = {"type": "object", "properties": {"z": {"type": "integer"}, "a": {"type": "integer"}}}
    for schema in (
        {"$defs": {"properties": inner, "b": inner}, "$ref": "#/$defs/properties"},
        {"type": "object", "properties": {"properties": inner, "x": inner}},
    ):
        text = make_output_spec(schema=schema).text
        assert text.count('"z":{"type":"integer"},"a"') == 2, text
    assert '"$defs":{"b":' in make_output_spec(schema={"$defs": {"properties": inner, "b": inner}}).text


def test_schema_true_is_any_json_value():
    # JSON Schema's boolean schema true accepts every value, as {} does (the backends take {}).
    assert make_output_spec(schema=True) == make_output_spec(schema="true") == make_output_spec(schema={})
    assert make_output_spec(schema=True).text == "{}"


def test_pydantic_types_and_parse():
    spec = make_output_spec(schema=Person)
    assert spec.python_type is Person and list(json.loads(spec.text)["properties"]) == ["name", "age"]
    value, obj = parse_output(spec, '{"name":"Ann","age":3}')
    assert value == {"name": "Ann", "age": 3} and obj == Person(name="Ann", age=3)
    lst = make_output_spec(schema=list[Person])
    assert parse_output(lst, '[{"name":"a","age":1}]')[1] == [Person(name="a", age=1)]
    assert parse_output(make_output_spec(schema=Point), '{"x":1,"y":2}')[1] == {"x": 1, "y": 2}
    assert parse_output(make_output_spec(schema=Box), '{"w":1,"h":2.5}')[1] == Box(1.0, 2.5)
    assert json.loads(make_output_spec(schema=int | None).text) == {"anyOf": [{"type": "integer"}, {"type": "null"}]}
    with pytest.raises(GrammarError, match="schema"):
        make_output_spec(schema=object())
    with pytest.raises(OutputValidationError) as refused:  # valid JSON, refused by the type
        parse_output(spec, '{"name":"Ann"}')
    assert refused.value.value == {"name": "Ann"}
    with pytest.raises(ValueError) as bad:
        parse_output(spec, '{"name":')
    assert not isinstance(bad.value, OutputValidationError)


def test_other_kinds():
    assert make_output_spec(regex="[0-9]+").kind == "regex"
    assert make_output_spec(grammar='start: "a"').kind == "lark"
    assert make_output_spec(grammar='root ::= "a"', grammar_syntax="gbnf").kind == "ebnf"
    ch = make_output_spec(choices=["yes", "no"])
    assert ch.kind == "choices" and json.loads(ch.text) == ["yes", "no"]
    obj = make_output_spec(response_format={"type": "json_object"}, json_whitespace=True, strict=False)
    assert obj.kind == "json_object" and obj.whitespace and not obj.strict
    assert parse_output(ch, "yes") == (None, "yes")
    assert parse_output(obj, '{"a": 1}') == ({"a": 1}, {"a": 1})


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"schema": "{not json"}, "schema"),
        ({"schema": 42}, "schema"),
        ({"schema": "[1, 2]"}, "schema"),
        ({"regex": ""}, "regex"),
        ({"grammar": 'start: "a"', "grammar_syntax": "yacc"}, "grammar_syntax"),
        ({"choices": "yes"}, "choices"),
        ({"choices": []}, "choices"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"schema": False}, "matches no JSON value"),
        ({"schema": "false"}, "matches no JSON value"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": False}}}, "matches no JSON value"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, word):
    with pytest.raises(GrammarError, match=word):
        make_output_spec(**kwargs)


def test_pydantic_models_are_closed_unless_extra_allowed():
    from pydantic import BaseModel, ConfigDict

    from constrained_serve.grammar.spec import make_output_spec

    class Item(BaseModel):
        name: str

    class Order(BaseModel):
        items: list[Item]

    class Open(BaseModel):
        model_config = ConfigDict(extra="allow")
        name: str

    closed = json.loads(make_output_spec(schema=Order).text)
    assert closed["additionalProperties"] is False
    assert closed["$defs"]["Item"]["additionalProperties"] is False
    assert json.loads(make_output_spec(schema=Open).text)["additionalProperties"] is True
