"""Per-field confidence (checked against HF log-probs) and partial objects while streaming."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Literal

import pytest
import torch
from pydantic import BaseModel

from constrained_serve import AsyncEngine, SamplingParams
from constrained_serve.errors import OutputError
from constrained_serve.json_spans import complete_members, scan


class Person(BaseModel):
    name: str
    age: int
    city: Literal["Paris", "Rome", "Oslo"]


BOUNDED = {
    "type": "object",
    "additionalProperties": False,
    "required": ["ok", "n", "tag"],
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "tag": {"enum": ["red", "green"]},
    },
}
TEXT = '{"name":"Zoë \\"Z\\"","age":31,"tags":["a",{"b":[1,2.5e3,null]}],"ok":false,"x y":{}}'


def test_spans_paths_and_completeness_at_every_prefix():
    spans, value, complete = scan(TEXT)
    assert complete and value == json.loads(TEXT)
    by_path = {s.path: TEXT[s.start : s.end] for s in spans}
    assert by_path["$.name"] == '"Zoë \\"Z\\""' and by_path["$.tags[1].b[1]"] == "2.5e3"
    assert by_path['$["x y"]'] == "{}" and by_path["$"] == TEXT
    for k in range(len(TEXT)):
        spans, value, complete = scan(TEXT[:k])
        assert not complete
        members = complete_members(TEXT[:k]) or {}
        full = json.loads(TEXT)
        # what is complete is exactly as in the full value, and never a number still growing
        assert all(full[key] == v for key, v in members.items()), (k, members)
        if TEXT[:k].endswith('"age":3'):
            assert "age" not in members


@pytest.mark.slow
def test_field_confidence_matches_hf_logprobs(default_engine):
    from transformers import AutoModelForCausalLM

    msgs = [{"role": "user", "content": "Invent a person as JSON with name, age and city."}]
    [r] = default_engine.chat(msgs, SamplingParams(max_tokens=60, field_confidence=True), schema=Person)
    assert r.finish_reason == "stop" and r.field_confidence is not None
    assert set(r.field_confidence) >= {"$", "$.name", "$.age", "$.city"}
    prompt = default_engine.encode_chat(msgs)
    hf = AutoModelForCausalLM.from_pretrained(str(default_engine.model_path), dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + r.token_ids])).logits[0, len(prompt) - 1 : -1]
    lp = torch.log_softmax(logits.float(), dim=-1)
    hf_token = [float(lp[i, t]) for i, t in enumerate(r.token_ids)]
    from constrained_serve.confidence import token_offsets

    offsets = token_offsets(default_engine.tokenizer, prompt[-4:], r.token_ids)
    for span in scan(r.text)[0]:
        sampled = [
            hf_token[i]
            for i, (a, b) in enumerate(offsets)
            if a < span.end and b > span.start and r.logprobs[i] is not None
        ]
        want = math.exp(sum(sampled))
        assert math.isclose(r.field_confidence[span.path], want, rel_tol=2e-3), (span.path, want)
    assert r.usage.forced_tokens > 0  # forced tokens (keys, punctuation) counted as certain


def test_partial_objects_sync_and_async(tiny_engine_factory):
    eng = tiny_engine_factory()
    p = SamplingParams(max_tokens=40)
    objs = list(eng.stream("A thing: ", p, schema=BOUNDED, partial=True))
    assert [len(o) for o in objs[:-1]] == sorted(len(o) for o in objs[:-1])  # fields only ever added
    final = objs[-1]
    assert final == json.loads(eng.generate(["A thing: "], p, schema=BOUNDED)[0].text)
    assert all(final[k] == v for o in objs for k, v in o.items())  # every partial agrees with the end

    async def main():
        async with AsyncEngine(eng) as ae:
            return [o async for o in ae.stream("A thing: ", p, schema=BOUNDED, partial=True)]

    assert asyncio.run(main()) == objs
    with pytest.raises(OutputError, match="not a complete valid object"):
        list(eng.stream("A thing: ", SamplingParams(max_tokens=3), schema=BOUNDED, partial=True))
    with pytest.raises(ValueError, match="needs a JSON output spec"):
        eng.stream("A thing: ", p, regex="[a-z]+", partial=True)


@pytest.mark.slow
def test_partial_pydantic_objects_on_the_default_model(default_engine):
    msgs = [{"role": "user", "content": "Invent a person as JSON with name, age and city."}]
    objs = list(default_engine.stream(msgs, SamplingParams(max_tokens=60), schema=Person, partial=True))
    assert isinstance(objs[-1], Person) and objs[-1].model_fields_set == {"name", "age", "city"}
    sets = [o.model_fields_set for o in objs[:-1]]
    assert sets[0] == {"name"} and all(a < b for a, b in zip(sets, sets[1:]))
    with pytest.raises(AttributeError):
        _ = objs[0].age  # not written yet: absent


def test_cli_confidence_column_and_display(tiny_engine_factory, tmp_path, capsys):
    from constrained_serve.cli import main
    from constrained_serve.display import result_repr_html

    eng = tiny_engine_factory()
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(BOUNDED))
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "text": f"row {i}"}) + "\n" for i in range(3)))
    out = tmp_path / "out.jsonl"
    assert (
        main(
            ["extract", str(src), "-o", str(out), "--schema", str(schema), "--confidence", "--max-tokens", "40"],
            engine=eng,
        )
        == 0
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    for row in rows:
        if "output" in row:
            assert set(row["confidence"]) == {"$", "$.ok", "$.n", "$.tag"}
            assert all(0 < p <= 1 for p in row["confidence"].values())
    [r] = eng.generate(["x"], SamplingParams(max_tokens=40, field_confidence=True), schema=BOUNDED)
    if r.finish_reason == "stop":
        assert "p=" in result_repr_html(r)
