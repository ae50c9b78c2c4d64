"""A call's inputs (inputs.py): prompts, token ids and message lists, one SamplingParams or
one per prompt, one output spec or one per prompt. A bad shared spec fails at submit, before
any model work; a bad item (prompt, message, spec) fails alone."""

import jsonschema
import pytest

from constrained_serve import GrammarError, SamplingParams

from .specs import Refused


def test_bad_items_fail_alone(tiny_engine_factory):
    """A token id outside the vocabulary or a message the chat template cannot render is that
    item's error Result; the others run (it used to crash the whole step)."""
    eng = tiny_engine_factory()
    p = SamplingParams(max_tokens=2, ignore_eos=True)
    rs = eng.generate(["fine", [eng.vocab_size + 5], [-1], [True, 5], [3, 4]], p)
    assert [r.error_type for r in rs] == [None, "ValueError", "ValueError", "ValueError", None]
    assert "outside the model's vocabulary" in rs[1].error
    rs = eng.chat([[{"role": "user", "content": "hi"}], [{"role": "user"}], [{"content": "x"}]], p)
    assert rs[0].error is None and rs[1].error_type == rs[2].error_type == "ValueError"


def test_per_prompt_specs_need_a_list_of_prompts(tiny_engine_factory):
    eng = tiny_engine_factory()
    with pytest.raises(TypeError, match="needs a list of prompts"):
        list(eng.generate_iter(iter(["a", "b"]), SamplingParams(max_tokens=2), regex=["a+", "b+"]))
    [r] = list(eng.generate_iter(iter(["a"]), SamplingParams(max_tokens=2), choices=["x", "y"]))  # one spec for all
    assert r.text in ("x", "y")


def test_one_sampling_params_per_prompt(tiny_engine_factory):
    """A list of SamplingParams applies one per prompt; each request keeps its own limits."""
    eng = tiny_engine_factory()
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (2, 5, 1)]
    rs = eng.generate(["a b", "c d", "e f"], params)
    assert [len(r.token_ids) for r in rs] == [2, 5, 1]
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        eng.generate(["a", "b", "c"], params[:2])
    with pytest.raises(TypeError, match="list of SamplingParams needs a list of prompts"):
        list(eng.generate_iter(iter(["a", "b", "c"]), params))
    with pytest.raises(TypeError, match="params must be a SamplingParams"):
        eng.generate(["a"], [{"max_tokens": 3}])


def test_chat_refuses_a_bare_string_or_message(tiny_engine_factory):
    """A str is iterable: without the check every character became a failed conversation."""
    eng = tiny_engine_factory()
    for wrong in ("hello", {"role": "user", "content": "hello"}):
        with pytest.raises(TypeError, match="list of .*messages.*generate"):
            eng.chat(wrong, SamplingParams(max_tokens=2))


def test_a_per_prompt_spec_the_backend_refuses_raises_grammar_error(tiny_engine_factory):
    eng = tiny_engine_factory()
    rs = eng.generate(["x", "y"], SamplingParams(max_tokens=4), schema=[Refused, {"not": {"type": "string"}}])
    assert rs[0].error_type != "GrammarError" and rs[1].error_type == "GrammarError"
    with pytest.raises(GrammarError, match="request 1"):
        eng.generate(
            ["x", "y"],
            SamplingParams(max_tokens=4),
            schema=[{"enum": [1]}, {"not": {"type": "string"}}],
            raise_on_error=True,
        )


def test_bad_shared_schema_fails_at_submit_before_model_work(tiny_engine_factory):
    eng = tiny_engine_factory()
    before = eng.core.runner.tokens_computed
    with pytest.raises(GrammarError):
        eng.generate(["a", "b"], SamplingParams(max_tokens=4), schema={"type": "object", "not": {"type": "string"}})
    with pytest.raises(GrammarError):
        eng.generate(["a"], SamplingParams(max_tokens=4), regex="(unclosed")
    assert eng.core.runner.tokens_computed == before


def test_bad_per_prompt_spec_fails_alone(tiny_engine_factory):
    eng = tiny_engine_factory()
    good = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    bad = {"type": "object", "not": {"type": "string"}}
    rs = eng.generate(["x", "y", "z"], SamplingParams(max_tokens=30), schema=[good, bad, None])
    assert rs[1].finish_reason == "abort" and rs[1].error_type == "GrammarError" and "not" in rs[1].error
    assert rs[0].error is None or rs[0].error_type == "truncated"
    if rs[0].finish_reason == "stop":
        jsonschema.validate(rs[0].json, good)
    assert rs[2].error is None


def test_per_prompt_spec_list_of_the_wrong_length_is_named(tiny_engine_factory):
    eng = tiny_engine_factory()
    p = SamplingParams(max_tokens=3)
    with pytest.raises(GrammarError, match="one spec per prompt; got 1 for 2 prompts"):
        eng.generate(["x", "y"], p, regex=["a"])
    with pytest.raises(GrammarError, match="got 3 for 2 prompts"):
        eng.generate(["x", "y"], p, choices=[["a"], ["b"], ["c"]])
    assert [r.text for r in eng.generate(["x", "y"], p, choices=["yes", "no"])] != []  # one spec for all
    assert eng.generate([], p, regex=[]) == []
