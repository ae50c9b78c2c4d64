"""Closed objects (closed_objects.py): an object schema that does not say additionalProperties
gets none, whatever way the schema comes (schema= dict or text, response_format with or
without strict, a Pydantic type); json_open_objects=True keeps the literal meaning; both
backends apply the same rule (checked on real schemas from ../shared/data)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from constrained_serve.errors import GrammarError
from constrained_serve.grammar import make_output_spec
from constrained_serve.grammar.closed_objects import close_objects

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT.parent / "shared" / "data" / "jsonschemabench"

INVOICE = {
    "type": "object",
    "properties": {"vendor": {"type": "string"}, "price": {"type": "number"}},
    "required": ["vendor"],
}


def _spec(**kw) -> dict:
    return json.loads(make_output_spec(**kw).text)


def test_every_way_in_closes_objects():
    nested = {"type": "object", "properties": {"invoice": INVOICE, "lines": {"type": "array", "items": INVOICE}}}
    for kw in (
        {"schema": nested},
        {"schema": json.dumps(nested)},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": nested}}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": nested, "strict": True}}},
    ):
        s = _spec(**kw)
        assert s["additionalProperties"] is False, kw
        assert s["properties"]["invoice"]["additionalProperties"] is False
        assert s["properties"]["lines"]["items"]["additionalProperties"] is False


def test_open_switch_keeps_the_literal_meaning_except_under_strict():
    assert "additionalProperties" not in _spec(schema=INVOICE, json_open_objects=True)
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": INVOICE}}
    assert "additionalProperties" not in _spec(response_format=rf, json_open_objects=True)
    strict = {"type": "json_schema", "json_schema": {"name": "x", "schema": INVOICE, "strict": True}}
    assert _spec(response_format=strict, json_open_objects=True)["additionalProperties"] is False
    # The closed and the open spec are different grammars (different cache keys).
    assert make_output_spec(schema=INVOICE) != make_output_spec(schema=INVOICE, json_open_objects=True)


def test_pydantic_types_stay_closed_under_the_switch():
    from pydantic import BaseModel

    class Item(BaseModel):
        name: str

    assert _spec(schema=Item, json_open_objects=True)["additionalProperties"] is False


@pytest.mark.parametrize(
    "extra",
    [{"additionalProperties": True}, {"additionalProperties": {"type": "integer"}}, {"patternProperties": {"^x": {}}}],
)
def test_an_explicit_word_on_extras_is_honoured(extra):
    s = _spec(schema={**INVOICE, **extra})
    for k, v in extra.items():
        assert s[k] == v
    if "additionalProperties" not in extra:
        assert "additionalProperties" not in s


def test_what_is_left_alone():
    assert close_objects({"type": "object"}) == {"type": "object"}  # a free-form object
    assert close_objects({"type": "object", "required": ["a"]}) == {"type": "object", "required": ["a"]}
    neg = {"not": {"properties": {"a": {"const": 1}}, "required": ["a"]}}
    assert close_objects(json.loads(json.dumps(neg))) == neg  # closing inside `not` would widen it
    data = {"type": "string", "enum": [{"properties": {}}], "default": {"properties": {"a": 1}}}
    assert close_objects(json.loads(json.dumps(data))) == data  # data, not schemas


def test_required_keys_count_as_declared():
    s = close_objects({"properties": {"a": {"type": "integer"}}, "required": ["a", "b"]})
    assert s["properties"] == {"a": {"type": "integer"}, "b": {}} and s["additionalProperties"] is False


def _valid(schema: dict, value) -> bool:
    import jsonschema

    return jsonschema.Draft202012Validator(schema).is_valid(value)


def test_all_of_closes_the_union_not_each_part():
    base = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}
    schema = {
        "$defs": {"Base": base},
        "allOf": [{"$ref": "#/$defs/Base"}, {"properties": {"name": {"type": "string"}}}],
        "properties": {"tag": {"type": "string"}},
    }
    s = close_objects(json.loads(json.dumps(schema)))
    assert _valid(s, {"id": 1, "name": "a", "tag": "t"})
    assert not _valid(s, {"id": 1, "name": "a", "other": 2})
    assert not _valid(s, {"id": "x"})  # the parts still apply
    assert s["$defs"]["Base"]["additionalProperties"] is False  # closed where used alone
    # two allOf parts without properties of their own
    s = close_objects({"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]})
    assert _valid(s, {"a": 1, "b": 2}) and not _valid(s, {"a": 1, "c": 3})


def test_alternatives_next_to_properties():
    schema = {
        "type": "object",
        "properties": {"kind": {"enum": ["a", "b"]}},
        "oneOf": [
            {"properties": {"kind": {"const": "a"}, "x": {"type": "integer"}}},
            {"properties": {"kind": {"const": "b"}, "y": {"type": "string"}}},
        ],
    }
    s = close_objects(json.loads(json.dumps(schema)))
    assert _valid(s, {"kind": "a", "x": 1}) and _valid(s, {"kind": "b", "y": "s"})
    assert not _valid(s, {"kind": "a", "y": "s"}) and not _valid(s, {"kind": "a", "x": 1, "z": 0})
    # alternatives alone close themselves
    s = close_objects({"anyOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]})
    assert _valid(s, {"a": 1}) and not _valid(s, {"a": 1, "b": 2})


def test_closing_keeps_the_corpus_valid_instances_that_have_no_undeclared_keys():
    """On every JSONSchemaBench schema: a valid instance that closing refuses has a key that
    the schema declares nowhere (never a composition made unsatisfiable)."""
    import jsonschema

    if not BENCH.is_dir():
        pytest.fail(f"shared data {BENCH} is missing (the repo's ../shared/data)")
    checked = 0
    for path in sorted(BENCH.iterdir()):
        doc = json.loads(path.read_text())
        valid = [t["data"] for t in doc.get("tests", []) if t["valid"]]
        closed = jsonschema.validators.validator_for(doc["schema"])(close_objects(doc["schema"]))
        for value in valid:
            try:
                leaves = [m for e in closed.iter_errors(value) for m in _leaf_messages(e)]
            except Exception:  # a remote or broken $ref: nothing to say here
                continue
            checked += 1
            if leaves and not any("Additional properties" in m for m in leaves):
                pytest.fail(f"{path.name}: closing refuses a valid instance for another reason: {leaves[:3]}")
    assert checked > 1000


def _leaf_messages(e) -> list[str]:
    if not e.context:
        return [e.message]
    return [m for c in e.context for m in _leaf_messages(c)]


@pytest.mark.slow
def test_both_backends_close_the_same_objects(manager, tokenizer):
    """The first 40 JSONSchemaBench schemas (with test instances) that closing changes and
    that both backends compile: on every instance, and on each object instance given one
    more, undeclared key, llguidance and xgrammar accept the same texts; the undeclared key
    is refused by both; instances that only the open schema takes are refused by both."""
    if not BENCH.is_dir():
        pytest.fail(f"shared data {BENCH} is missing (the repo's ../shared/data)")
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    import conformance

    def accepts(spec, backend: str, text: str) -> bool:
        m = manager.new_matcher(manager.compile(spec, backend))
        try:
            return m.accept_tokens(tokenizer.encode(text, add_special_tokens=False)) and m.can_end()
        except GrammarError:
            return False

    schemas = instances = extra_refused = only_open = 0
    for path in sorted(BENCH.iterdir()):
        doc = json.loads(path.read_text())
        if not doc.get("tests"):
            continue
        spec = make_output_spec(schema=doc["schema"])
        open_spec = make_output_spec(schema=doc["schema"], json_open_objects=True)
        if spec == open_spec:
            continue
        try:
            for b in ("llguidance", "xgrammar"):
                manager.compile(spec, b)
        except GrammarError:
            continue
        schemas += 1
        closed = json.loads(spec.text)
        for t in doc["tests"]:
            values = [t["data"]]
            if isinstance(t["data"], dict) and closed.get("additionalProperties") is False:
                values.append({**t["data"], "zz_undeclared": 1})
            for i, value in enumerate(values):
                text = conformance.serialize(value, closed)
                got = {b: accepts(spec, b, text) for b in ("llguidance", "xgrammar")}
                assert got["llguidance"] == got["xgrammar"], f"{path.name}: backends disagree on {text[:200]}"
                instances += 1
                if i == 1:
                    assert not got["llguidance"], f"{path.name}: an undeclared key was accepted: {text[:200]}"
                    extra_refused += 1
                elif not got["llguidance"] and accepts(open_spec, "llguidance", text):
                    only_open += 1
        if schemas == 40:
            break
    print(f"{schemas} schemas, {instances} instances, {extra_refused} undeclared keys refused, {only_open} open-only")
    assert schemas == 40 and extra_refused >= 20 and only_open >= 1


@pytest.mark.slow
def test_the_default_model_keeps_to_the_declared_keys(engine):
    """docs/serving.md's example: with the literal (open) schema the default model invented
    "description" and "price"; closed, it writes the declared key only. The same through a
    Pydantic model's model_json_schema() given as a dict (which never says additionalProperties)."""
    from pydantic import BaseModel

    from constrained_serve import SamplingParams

    class Invoice(BaseModel):
        vendor: str
        total: float

    messages = [{"role": "user", "content": "ACME GmbH billed us 99 EUR."}]
    schema = {"type": "object", "properties": {"vendor": {"type": "string", "maxLength": 40}}, "required": ["vendor"]}
    rf = {"type": "json_schema", "json_schema": {"name": "invoice", "schema": Invoice.model_json_schema()}}
    params = SamplingParams(max_tokens=60)
    [closed] = engine.chat(messages, params, schema=schema)
    [from_pydantic] = engine.chat(messages, params, response_format=rf)
    [literal] = engine.chat(messages, params, schema=schema, json_open_objects=True)
    assert closed.finish_reason == "stop" and list(closed.json) == ["vendor"], closed.text
    assert from_pydantic.finish_reason == "stop" and list(from_pydantic.json) == ["vendor", "total"], from_pydantic.text
    assert literal.json is not None and "vendor" in literal.json  # the switch reaches the engine (may add keys)
