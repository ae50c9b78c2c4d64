"""tools/stream.py: a tool-calling output read as it streams, split anywhere."""

from __future__ import annotations

import json
import random

import pytest

from constrained_serve.tools.formats import HERMES, LLAMA3_JSON
from constrained_serve.tools.stream import CallStream

CALLS = [
    ("get_weather", {"city": 'Ro"me {x} [y]', "unit": "celsius", "nested": {"a": [1, {"b": "\\\\"}]}}),
    ("search", {"query": "caf\u00e9 \U0001f600 \\n"}),
]


def _run(text: str, fmt, cuts: list[int]) -> tuple[str, list[dict], list[int]]:
    stream = CallStream(fmt)
    content, calls, pieces = "", {}, []
    bounds = [0, *cuts, len(text)]
    for a, b in zip(bounds, bounds[1:]):
        c, deltas = stream.feed(text[a:b])
        content += c
        for d in deltas:
            entry = calls.setdefault(d.index, {"id": None, "name": None, "arguments": "", "done": False})
            if d.id is not None:
                assert entry["id"] is None and d.arguments == ""
                entry["id"], entry["name"] = d.id, d.name
            entry["arguments"] += d.arguments
            entry["done"] |= d.done
            pieces.append(d.index)
    content += stream.close()
    return content, [calls[i] for i in sorted(calls)], pieces


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON], ids=lambda f: f.name)
def test_calls_read_as_they_stream_split_anywhere(fmt):
    text = "Sure, let me look <tool that up. " + fmt.separator.join(fmt.write(n, a) for n, a in CALLS)
    rng = random.Random(0)
    for trial in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(30, len(text) - 1))))
        content, calls, _ = _run(text, fmt, cuts)
        assert content == "Sure, let me look <tool that up. "
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == CALLS, trial
        assert all(c["done"] and c["id"].startswith("call_") for c in calls)
    # one character at a time: the arguments come in many pieces, each call's head first
    content, calls, pieces = _run(text, fmt, list(range(1, len(text))))
    assert pieces.count(0) > 10 and pieces == sorted(pieces)


def test_text_without_calls_is_all_content_and_a_cut_call_is_incomplete():
    text = "no calls here, only <tool_ and text"
    assert _run(text, HERMES, list(range(1, len(text))))[0] == text
    cut = HERMES.write(*CALLS[0])[:-20]  # max_tokens inside the arguments
    content, [call], _ = _run(cut, HERMES, [5, 30])
    assert content == "" and call["name"] == "get_weather" and not call["done"]
    assert HERMES.write(*CALLS[0]).find(call["arguments"]) > 0
