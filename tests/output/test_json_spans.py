"""JSON spans (json_spans.py): the path and extent of every value in a JSON text, and which
members are complete, at every prefix of the text."""

from __future__ import annotations

import json

from constrained_serve.output.json_spans import complete_members, scan

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
