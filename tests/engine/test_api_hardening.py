"""Issue #41, the Python API: what a caller gets wrong gets a clear error, at once."""

from __future__ import annotations

import re

import pytest
from pydantic import BaseModel

from constrained_serve import GrammarError, SamplingParams

from ..helpers import deep_schema as _deep


class Person(BaseModel):
    name: str
    age: int


PEOPLE = [{"role": "user", "content": "List the people as JSON: Ann is 22, Bob is 45."}]


@pytest.mark.timeout(300)
def test_a_deep_per_prompt_schema_fails_alone(default_engine):
    bad, good = default_engine.generate(
        ["x", "y"], SamplingParams(max_tokens=4), schema=[_deep(1000), {"type": "integer"}]
    )
    assert bad.finish_reason == "abort" and "nests deeper" in bad.error
    assert good.finish_reason != "abort"
    with pytest.raises(GrammarError, match="nests deeper"):
        default_engine.generate("x", schema=_deep(1000))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("regex", ["a{1000000}", "(a{1000}){1000}"])
def test_a_regex_too_large_says_so(default_engine, regex):
    with pytest.raises(GrammarError) as e:
        default_engine.generate("x", SamplingParams(max_tokens=4), regex=regex)
    assert "too many expressions" in str(e.value) and "matches no text" not in str(e.value)


@pytest.mark.timeout(300)
def test_a_regex_invalid_in_python_is_invalid(default_engine):
    with pytest.raises(GrammarError, match="not a valid regular expression: multiple repeat"):
        default_engine.generate("x", regex="a{1000}{1000}")


@pytest.mark.timeout(300)
def test_digits_are_ascii_by_default(default_engine, tiny_engine_factory):
    r = default_engine.generate("Today's date:", SamplingParams(max_tokens=16), regex=r"\d{4}-\d{2}-\d{2}")[0]
    assert re.fullmatch("[0-9]{4}-[0-9]{2}-[0-9]{2}", r.text), r.text
    # A random-weight model picks among every token the mask allows: only ASCII digits here.
    tiny = tiny_engine_factory(max_num_seqs=8)
    params = SamplingParams(max_tokens=12, temperature=1.5, seed=3, n=4)
    for s in tiny.generate("x", params, regex=r"\d{8}")[0].samples:
        assert re.fullmatch("[0-9]{8}", s.text), s.text
    sample = tiny.generate("x", params, schema={"type": "string", "pattern": r"^\w{6}$"})[0]
    for s in sample.samples:
        assert re.fullmatch('"[0-9A-Za-z_]{6}"', s.text), s.text


@pytest.mark.timeout(300)
def test_sampling_fields_as_keywords(default_engine):
    [r] = default_engine.generate("The answer is", schema={"type": "integer"}, max_tokens=3)
    assert r.usage.completion_tokens <= 3
    [r] = default_engine.chat(PEOPLE, max_tokens=2, temperature=0.5, seed=1)
    assert r.usage.completion_tokens <= 2
    with pytest.raises(TypeError, match="not both"):
        default_engine.generate("x", SamplingParams(), max_tokens=3)
    with pytest.raises(ValueError, match="max_tokens"):
        default_engine.generate("x", max_tokens=0)


@pytest.mark.timeout(300)
def test_chat_with_a_list_of_strings_raises_at_once(default_engine):
    with pytest.raises(TypeError, match="list of strings"):
        default_engine.chat(["Ann is 22.", "Bob is 45."])


@pytest.mark.timeout(300)
def test_two_specs_in_one_call_is_a_usage_error(default_engine):
    with pytest.raises(TypeError, match="at most one output constraint"):
        default_engine.generate("x", schema={"type": "integer"}, regex="a")


@pytest.mark.timeout(300)
def test_type_adapter_schemas_produce_values(default_engine):
    params = SamplingParams(max_tokens=60)
    [r] = default_engine.chat(PEOPLE, params, schema=list[Person])
    assert r.parsed and all(isinstance(p, Person) for p in r.parsed), r.text
    ages = [{"role": "user", "content": 'Give the ages as a JSON object such as {"Ann": 22}: Ann is 22, Bob is 45.'}]
    [r] = default_engine.chat(ages, params, schema=dict[str, int])
    assert isinstance(r.parsed, dict) and all(isinstance(v, int) for v in r.parsed.values()), r.text
    [r] = default_engine.chat(PEOPLE, params, schema=Person | int)
    assert isinstance(r.parsed, (Person, int)), r.text
