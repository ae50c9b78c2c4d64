"""/v1/responses (server/responses.py), driven by the official ``openai`` client: string and
message input, instructions, text.format (json_schema strict, json_object), responses.parse,
the typed event stream, max_output_tokens, and what is refused (previous_response_id, tools that are not functions)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

SCHEMA = {
    "type": "object",
    "required": ["ok", "n"],
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
}


class Thing(BaseModel):
    ok: bool
    n: int = Field(ge=0, le=9)


@pytest.fixture
def served(tiny_served):
    return tiny_served


@pytest.fixture
def client(tiny_client):
    return tiny_client


@pytest.mark.timeout(120)
def test_string_input_and_messages_with_instructions(client):
    r = client.responses.create(model="tiny", input="Say something", max_output_tokens=8, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.status in ("completed", "incomplete")
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert r.output_text == item.content[0].text
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 8
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # instructions are a system message in front; content parts are read as text
    r = client.responses.create(
        model="tiny",
        instructions="Be brief.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Say something"}]}],
        max_output_tokens=8,
        temperature=0,
    )
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something"}],
        max_tokens=8,
        temperature=0,
    )
    assert r.output_text == chat.choices[0].message.content and r.instructions == "Be brief."


@pytest.mark.timeout(120)
def test_text_format_json_schema_and_json_object(client):
    fmt = {"type": "json_schema", "name": "thing", "schema": SCHEMA, "strict": True}
    r = client.responses.create(model="tiny", input="A thing as JSON", text={"format": fmt}, max_output_tokens=40)
    assert r.status == "completed"
    value = json.loads(r.output_text)
    jsonschema.validate(value, {**SCHEMA, "additionalProperties": False})
    assert r.text.format.type == "json_schema"
    r = client.responses.create(
        model="tiny", input="JSON", text={"format": {"type": "json_object"}}, max_output_tokens=200, temperature=0
    )
    assert r.output_text.startswith("{")
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text), dict)


@pytest.mark.timeout(120)
def test_parse_returns_the_model(client):
    r = client.responses.parse(model="tiny", input="A thing", text_format=Thing, max_output_tokens=40)
    assert isinstance(r.output_parsed, Thing)


@pytest.mark.timeout(120)
def test_streaming_events(client):
    with client.responses.stream(model="tiny", input="A thing", text_format=Thing, max_output_tokens=40) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 2 and "".join(deltas) == final.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert isinstance(final.output_parsed, Thing) and final.status == "completed"
    # create(stream=True): the raw events; an output cut at max_output_tokens ends incomplete
    raw = list(client.responses.create(model="tiny", input="Tell a story", max_output_tokens=4, stream=True))
    assert raw[0].type == "response.created" and raw[-1].type == "response.incomplete"
    assert raw[-1].response.incomplete_details.reason == "max_output_tokens"
    text = "".join(e.delta for e in raw if e.type == "response.output_text.delta")
    assert text == raw[-1].response.output[0].content[0].text


@pytest.mark.timeout(120)
def test_max_output_tokens_cut_is_incomplete(client):
    r = client.responses.create(model="tiny", input="Tell a long story", max_output_tokens=3, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"


@pytest.mark.timeout(120)
def test_refusals_are_openai_errors(served, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="hi", previous_response_id="resp_123")
    assert "previous_response_id" in e.value.message and e.value.body["type"] == "invalid_request_error"
    tool = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="hi", tools=[{"type": "file_search", "vector_store_ids": []}])
    assert "file_search" in e.value.message and "function tools only" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="hi", tool_choice="required")
    assert "needs tools" in e.value.message
    r = client.responses.create(model="tiny", input="hi", tools=[tool], tool_choice="none", max_output_tokens=2)
    assert r.status in ("completed", "incomplete")  # tools that must not be called are ignored
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="hi", extra_body={"no_such_field": 1})
    assert "no_such_field" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input=[{"type": "reasoning", "summary": []}])
    assert "reasoning" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input=[{"type": "function_call_output", "output": "1"}])
    assert "call_id" in e.value.message
    resp = httpx.get(f"{served.url}/v1/nothing-here")
    assert resp.status_code == 404 and resp.json()["error"]["type"] == "invalid_request_error"
