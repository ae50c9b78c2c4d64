"""Grounded fields through the server: extra_body grounded / source_text, spans on the choices."""

from __future__ import annotations

import json

import openai
import pytest

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30}}, "required": ["name"]}


@pytest.fixture
def client(tiny_client):
    return tiny_client


@pytest.mark.timeout(180)
def test_grounded_values_quote_the_user_message_or_source_text(client):
    rf = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}
    message = 'Ann "Annie" Lee <ann@x.io> 😀\nline two'
    source = "Only these words: Bo Chen"
    for extra, text in (({"grounded": True}, message), ({"grounded": "chars", "source_text": source}, source)):
        r = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": message}],
            max_tokens=40,
            n=3,
            temperature=1.0,
            seed=7,
            response_format=rf,
            extra_body=extra,
        )
        for c in r.choices:
            assert c.finish_reason == "stop", c
            name = json.loads(c.message.content)["name"]
            assert name in text
            spans = c.model_extra["spans"]
            if name:
                start, end = spans["$.name"]
                assert text[start:end] == name


def test_grounding_refused_by_xgrammar_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="xgrammar cannot compile grounded"):
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=5,
            extra_body={"guided_json": SCHEMA, "grounded": True, "guided_decoding_backend": "xgrammar"},
        )
