"""Per-field confidence (confidence.py): checked against HF log-probs on the default model,
and shown by extract --confidence and the HTML view of a Result."""

from __future__ import annotations

import json
import math

import pytest
import torch

from constrained_serve import SamplingParams
from constrained_serve.output.json_spans import scan

from ..engine.specs import BOUNDED, Person


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
    from constrained_serve.output.confidence import token_offsets

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


def test_cli_confidence_column_and_display(tiny_engine_factory, tmp_path, capsys):
    from constrained_serve.cli import main
    from constrained_serve.output.display import result_repr_html

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
