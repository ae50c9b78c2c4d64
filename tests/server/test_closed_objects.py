"""JSON Schema objects are closed on the server too: response_format json_schema (strict or
not) and guided_json; extra_body json_open_objects keeps JSON Schema's literal meaning."""

from __future__ import annotations

import json

import pytest

from constrained_serve.server import protocol as P

OPEN = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.fixture
def client(tiny_client):
    return tiny_client


def test_the_open_switch_reaches_the_spec():
    body = {"messages": [{"role": "user", "content": "x"}], "guided_json": OPEN}
    assert "json_open_objects" not in P.spec_kwargs(P.ChatCompletionRequest(**body))
    assert P.spec_kwargs(P.ChatCompletionRequest(**body, json_open_objects=True))["json_open_objects"] is True


@pytest.mark.timeout(180)
def test_objects_are_closed_however_the_schema_comes(client):
    """A random-weight model writes whatever the grammar lets it: with the objects closed,
    never a key of its own."""
    rf = {"type": "json_schema", "json_schema": {"name": "t", "schema": OPEN}}
    strict = {"type": "json_schema", "json_schema": {"name": "t", "schema": OPEN, "strict": True}}
    for kw in ({"response_format": rf}, {"response_format": strict}, {"extra_body": {"guided_json": OPEN}}):
        r = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "JSON"}],
            max_tokens=30,
            n=4,
            temperature=1.0,
            seed=3,
            **kw,
        )
        for c in r.choices:
            assert c.finish_reason == "stop" and list(json.loads(c.message.content)) == ["ok"], (kw, c.message.content)
