"""Tool calling end to end on the default model (SmolLM2-135M-Instruct, whose template takes
no tools: our default system prompt), in every tool_choice mode."""

from __future__ import annotations

import jsonschema
import pytest

from constrained_serve import GrammarError, SamplingParams

from .tool_set import FEW_SHOT, SCHEMAS, TOOLS

pytestmark = pytest.mark.slow

ASKS = [
    "What is the weather in Paris?",
    "Book a flight from JFK to LAX for Ann, 34.",
    "Ship 2 kg to 12 Main Street, 10001.",
    "Search the web for llama recipes.",
    "Tell me a joke.",
    "What is 2 + 2?",
    "Use a tool to find the weather in Oslo.",
    "Hi!",
]


def chat(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def assert_valid(r) -> None:
    """A call the engine returns parses and validates against its function's schema as given."""
    assert r.error is None, r.error
    for c in r.tool_calls or []:
        jsonschema.validate(c.arguments, SCHEMAS[c.name])


@pytest.mark.timeout(600)
def test_required_named_and_none(default_engine):
    p = SamplingParams(max_tokens=100, temperature=1.0, seed=3)
    rs = default_engine.chat(
        [chat(a) for a in ASKS[:3]], p, tools=TOOLS, tool_choice="required", parallel_tool_calls=False
    )
    for r in rs:
        assert r.finish_reason == "stop" and r.tool_calls, r.text
        assert_valid(r)
    named = {"type": "function", "function": {"name": "ship_parcel"}}
    rs = default_engine.chat(chat(ASKS[2]), p, tools=TOOLS, tool_choice=named, parallel_tool_calls=False)
    for r in rs:
        assert [c.name for c in r.tool_calls] == ["ship_parcel"] and r.content is None
        assert_valid(r)
    [r] = default_engine.chat(chat("Hi"), SamplingParams(max_tokens=20), tools=TOOLS, tool_choice="none")
    assert r.tool_calls is None and r.content == r.text


@pytest.mark.timeout(900)
def test_auto_mode_calls_always_parse_and_validate(default_engine):
    """32 requests at temperature 1 over 4 tools with nested parameters: every call returned
    parses and matches its schema; the model decides between text and calls."""
    params = [SamplingParams(max_tokens=100, temperature=1.0, seed=i) for i in range(32)]
    convs = [FEW_SHOT + chat(ASKS[i % len(ASKS)]) for i in range(32)]
    rs = default_engine.chat(convs, params, tools=TOOLS)
    calls = 0
    for r in rs:
        if r.finish_reason == "length":  # text or a call cut by max_tokens: said so, never returned as a call
            assert r.tool_calls is None
            continue
        assert_valid(r)
        calls += bool(r.tool_calls)
        if r.tool_calls is None:
            assert "<tool_call>" not in r.text
    assert calls >= 4  # the test means something: it saw calls (about 20 of 32 here)


@pytest.mark.timeout(300)
def test_bad_tools_fail_at_submit(default_engine):
    bad = {
        "type": "function",
        "function": {"name": "broken", "parameters": {"type": "object", "properties": {"a": {"type": "strng"}}}},
    }
    with pytest.raises(GrammarError, match="broken"):
        default_engine.chat(chat("x"), tools=[TOOLS[0], bad], tool_choice="required")
    with pytest.raises(GrammarError, match="llguidance"):
        default_engine.chat(chat("x"), tools=TOOLS, grammar_backend="xgrammar")
    with pytest.raises(GrammarError, match="schema"):
        default_engine.chat(chat("x"), tools=TOOLS, schema={"type": "object"})
    with pytest.raises(TypeError, match="chat"):
        default_engine.generate("x", tools=TOOLS)
    with pytest.raises(ValueError, match="needs tools"):
        default_engine.chat(chat("x"), tool_choice="required")
