"""Grounded fields through Engine.generate / chat (inputs.py, grammar/grounded_inputs.py):
the source each item quotes, Result.spans, the Jupyter repr; one run on the default model."""

from __future__ import annotations

import pytest

from constrained_serve import GrammarError, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "string", "maxLength": 30}, "b": {"type": ["string", "null"], "maxLength": 30}},
    "required": ["a", "b"],
}


@pytest.fixture(scope="module")
def tiny(tiny_engine_factory):
    return tiny_engine_factory()


def test_generate_quotes_the_prompt_or_source_text(tiny):
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=11, n=2)
    prompts = ["Write about Zoë Müller (zoe@acme.de).", 'He said "hi"\\ twice: hi hi']
    sources = [None, "a list of sources: one per prompt"]
    for kw in ({}, {"source_text": [s or p for s, p in zip(sources, prompts)]}):
        for r, prompt, src in zip(tiny.generate(prompts, params, schema=SCHEMA, grounded=True, **kw), prompts, sources):
            text = (src or prompt) if kw else prompt
            assert r.source_text == text
            for s in r.samples:
                assert s.ok, s.error
                for value in s.json.values():
                    assert value is None or value in text
                for path, (start, end) in s.spans.items():
                    assert text[start:end] == s.json[path[2:]]


def test_bad_grounding_arguments_fail_at_the_call(tiny):
    with pytest.raises(ValueError, match="grounded must be"):
        tiny.generate(["x"], schema=SCHEMA, grounded="sentences")
    with pytest.raises(GrammarError, match="need a JSON Schema"):
        tiny.generate(["x"], regex="[a-z]+", grounded=True)
    with pytest.raises(GrammarError, match="xgrammar cannot compile grounded"):
        tiny.generate(["x"], schema=SCHEMA, grounded=True, grammar_backend="xgrammar")


@pytest.mark.slow
def test_default_model_quotes_the_user_message(engine):
    from pydantic import BaseModel

    from constrained_serve import Grounded

    class Contact(BaseModel):
        name: Grounded
        email: Grounded | None

    message = 'Hi, I\'m Zoë "Z" Müller from Acme.\nWrite to zoe@acme.de 😀'
    [r] = engine.chat(
        [{"role": "system", "content": "Extract the contact."}, {"role": "user", "content": message}],
        SamplingParams(max_tokens=40),
        schema=Contact,
    )
    assert r.ok and r.source_text == message, r.error
    assert r.parsed.name in message and (r.parsed.email is None or r.parsed.email in message)
    for path, (start, end) in r.spans.items():
        assert message[start:end] == r.json[path[2:]]
    if r.spans:
        assert "<mark" in r._repr_html_() and "spans=" in repr(r)
