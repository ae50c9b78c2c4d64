from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import time
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict

from constrained_serve.errors import GrammarError, OutputValidationError
from constrained_serve.grammar import make_output_spec, parse_output

from .grammar_test_types import Person, Point

GRAMMARS = Path(__file__).resolve().parents[2] / "grammars"


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
    assert s1.text == '{"properties":{"b":{"type":"integer"},"a":{"type":"string"}},"required":["a"],"type":"object"}'


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
        ({"schema": {"type": "object"}, "regex": "a"}, "schema, regex"),
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


def test_a_finished_output_is_checked_against_the_spec_as_the_user_reads_it():
    """The last line of the guarantee: where a backend read the spec more loosely (xgrammar's
    ASCII \\w, llguidance's Rust Unicode tables, a schema keyword it dropped), the finished
    output is reported (OutputValidationError, JSON kept), never passed as valid."""
    from constrained_serve.errors import OutputValidationError

    regex = make_output_spec(regex=r"\w+")
    assert parse_output(regex, "é日") == (None, "é日")
    with pytest.raises(OutputValidationError, match="re.fullmatch"):
        parse_output(regex, "हिंदी")  # Rust's \w takes the combining vowel signs, Python's does not
    assert parse_output(make_output_spec(regex=r"\p{L}+"), "x") == (None, "x")  # not Python syntax: no check
    schema = {
        "type": "object",
        "properties": {"b": {"type": "string"}},
        "patternProperties": {".*": {"type": "string"}},
        "required": ["b"],
    }
    with pytest.raises(OutputValidationError, match="at k") as e:
        parse_output(make_output_spec(schema=schema), '{"b":"a","k":-2}')
    assert e.value.value == {"b": "a", "k": -2}
    # strict=False accepted the backend's approximation: its outputs stand.
    assert parse_output(make_output_spec(schema=schema, strict=False), '{"b":"a","k":-2}')[0] == {"b": "a", "k": -2}
    assert parse_output(make_output_spec(regex=r"\w+", strict=False), "हिंदी")[1] == "हिंदी"


def test_the_conformance_check_never_flags_valid_outputs():
    """Float multipleOf (jsonschema's float division), draft-04 booleans without $schema and
    Rust-only regex classes are left to the backend rather than reported as errors."""
    price = make_output_spec(schema={"type": "object", "properties": {"p": {"type": "number", "multipleOf": 0.01}}})
    assert parse_output(price, '{"p":19.99}')[0] == {"p": 19.99}
    old = make_output_spec(schema={"type": "integer", "minimum": 0, "exclusiveMinimum": True})
    assert parse_output(old, "1")[0] == 1
    assert parse_output(make_output_spec(regex="[[:alpha:]]+"), "abc")[1] == "abc"
    # Lark: what lark cannot read (llguidance's special tokens, Rust-only regex) goes unchecked,
    # and lark's LALR parser refusing a valid text (a shift/reduce conflict lark resolved
    # silently: " + " in arith.lark) is not a refusal: its Earley parser decides.
    assert parse_output(make_output_spec(grammar='start: "a" <[2]>'), "a")[1] == "a"
    assert parse_output(make_output_spec(grammar="start: /\\p{L}+/"), "abc")[1] == "abc"
    arith = (GRAMMARS / "arith.lark").read_text()
    assert parse_output(make_output_spec(grammar=arith), "1 + 2 * 3")[1] == "1 + 2 * 3"
    long = " + ".join(["(12.5 - 3)"] * 40)  # past the Earley length bound, LALR refuses: unchecked
    assert len(long) > 256 and parse_output(make_output_spec(grammar=arith), long)[1] == long


def test_the_final_regex_check_is_bounded(caplog):
    """re.fullmatch backtracks exponentially on some pattern and text pairs, and a text that
    does not match is what the check exists for. The check runs with a time bound: re took
    ~20 s for this one (and 4x longer per extra character)."""
    t0 = time.perf_counter()
    with pytest.raises(OutputValidationError, match="re.fullmatch"):
        parse_output(make_output_spec(regex=r"(\w+\s?)+"), "a" * 28 + "!")
    assert time.perf_counter() - t0 < 3
    # Still Python's \w (the regex package's own takes the combining marks of "हिंदी").
    with pytest.raises(OutputValidationError):
        parse_output(make_output_spec(regex=r"(\w+\s?)+"), "हिंदी")
    # A match that runs past the bound is left unchecked, and says so.
    t0 = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="constrained_serve.grammar.regex_check"):
        assert parse_output(make_output_spec(regex="(a|a)+b"), "a" * 28) == (None, "a" * 28)
    assert time.perf_counter() - t0 < 3 and "left unchecked" in caplog.text


def test_schema_patterns_are_checked_as_ecma_262_reads_them_within_a_bound(caplog):
    r"""A JSON Schema pattern means what it means in ECMA-262: \w and \d are ASCII, so \W takes
    "é" (as both backends do); jsonschema's re.search refused it, after backtracking for
    seconds. Its \s is ECMA's (U+FEFF, not U+001C). patternProperties and
    additionalProperties read their patterns the same way."""
    spec = make_output_spec(schema={"type": "string", "pattern": "^(\\W+\\s?)+$"})
    t0 = time.perf_counter()
    assert parse_output(spec, '"' + "!" * 26 + 'é"')[0] == "!" * 26 + "é"
    assert time.perf_counter() - t0 < 3
    with pytest.raises(OutputValidationError, match="does not match"):
        parse_output(spec, '"!a"')
    space = make_output_spec(schema={"type": "string", "pattern": "^\\s$"})
    assert parse_output(space, '"\\ufeff"')[0] == "\ufeff"
    with pytest.raises(OutputValidationError):
        parse_output(space, '"\\u001c"')
    keys = make_output_spec(
        schema={"type": "object", "patternProperties": {"^\\W+$": {"type": "integer"}}, "additionalProperties": False}
    )
    assert parse_output(keys, '{"é":1}')[0] == {"é": 1}
    with pytest.raises(OutputValidationError, match="at é"):
        parse_output(keys, '{"é":"x"}')
    with pytest.raises(OutputValidationError, match="do not match any of the regexes"):
        parse_output(keys, '{"a":1,"b":2}')
    # Past the bound: unchecked, with a warning.
    slow = make_output_spec(schema={"type": "string", "pattern": "^(a|a)+$"})
    t0 = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="constrained_serve.grammar.regex_check"):
        assert parse_output(slow, '"' + "a" * 28 + 'b"')[0] == "a" * 28 + "b"
    assert time.perf_counter() - t0 < 3 and "left unchecked" in caplog.text


class Note(BaseModel):
    model_config = ConfigDict(strict=True)
    when: datetime.datetime
    text: str


def test_a_lone_surrogate_escape_parses_into_the_type(manager):
    """'\\ud800' is valid JSON text that xgrammar's JSON grammar allows and json.loads reads,
    but Pydantic's JSON parser refuses (json_invalid): parsed then comes from the json.loads
    value, in lax Python mode, so a strict model still reads its ISO datetime string, and
    json and parsed hold the same string."""
    spec = make_output_spec(schema=Note)
    text = '{"when":"2024-01-01T09:00:00Z","text":"a\\ud800"}'
    assert manager.matches(manager.compile(spec, "xgrammar"), text)
    value, parsed = parse_output(spec, text)
    assert value == {"when": "2024-01-01T09:00:00Z", "text": "a\ud800"}
    assert parsed == Note(when=datetime.datetime(2024, 1, 1, 9, tzinfo=datetime.timezone.utc), text="a\ud800")
    assert parsed.text == value["text"]
    # The type's own refusals still stand, with the JSON kept.
    with pytest.raises(OutputValidationError) as refused:
        parse_output(spec, '{"when":"soon","text":"\\ud800"}')
    assert refused.value.value == {"when": "soon", "text": "\ud800"}


def test_the_lark_deadline_only_cuts_the_code_it_bounds():
    """The deadline is checked at calls of functions under the bounded folder only: a
    finalizer or collector callback that runs meanwhile (elsewhere) is never cut short."""
    import os
    import time as clock

    from constrained_serve.grammar.output_check import _call_with_deadline, _Deadline

    here = os.path.dirname(os.path.abspath(__file__)) + os.sep
    calls_elsewhere = []

    def bounded_work():
        end = clock.perf_counter() + 0.05
        while clock.perf_counter() < end:
            pass
        calls_elsewhere.append(json.dumps([1]))  # json is not under ``here``: not cut
        _inner()  # defined here: cut

    def _inner():
        raise AssertionError("reached past the deadline")

    with pytest.raises(_Deadline):
        _call_with_deadline(bounded_work, 0.01, here)
    assert calls_elsewhere == ["[1]"]
    assert _call_with_deadline(lambda: 7, 1.0, here) == 7
