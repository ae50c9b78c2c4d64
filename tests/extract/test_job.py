"""The JSONL job of ``constrained-serve extract`` (job.py), without a model: prompts, input
lines to items and early error rows, results to rows, the summary, and the in-order merge of
early error rows with engine results, resumed runs included. The same paths run on the real
model in tests/cli/test_extract_command.py."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from constrained_serve.extract.inputs import (
    INVALID_ID,
    INVALID_JSON,
    INVALID_UTF8,
    MISSING_FIELD,
    NOT_OBJECT,
    PromptBuilder,
    read_items,
)
from constrained_serve.extract.job import TRUNCATED, JobStats, result_row, run_extract
from constrained_serve.extract.output import open_sinks, row_key


def lines(*texts: str | bytes) -> list[bytes]:
    return [t if isinstance(t, bytes) else (t + "\n").encode() for t in texts]


# ---------------------------------------------------------------------------------------
# prompts


def test_prompt_builder_field_and_instructions() -> None:
    b = PromptBuilder(field="body", instructions="Extract it.")
    assert b.build({"body": "hello"}) == [
        {"role": "system", "content": "Extract it."},
        {"role": "user", "content": "hello"},
    ]
    assert PromptBuilder().build({"text": "x"}) == [{"role": "user", "content": "x"}]


def test_prompt_builder_template_uses_several_fields_and_dumps_non_strings() -> None:
    b = PromptBuilder(template="Title: {title}\nTags: {tags}\n{{literal}}")
    msgs = b.build({"title": "Broken", "tags": ["a", "b"]})
    assert msgs[-1]["content"] == 'Title: Broken\nTags: ["a", "b"]\n{literal}'
    with pytest.raises(KeyError, match="tags"):
        b.build({"title": "only"})
    with pytest.raises(KeyError):
        b.build({"title": "x", "tags": None})  # null counts as missing


@pytest.mark.parametrize("template", ["{", "no fields", "{0}", "{a.b}", "{a[0]}", "n={n:d}", "{text!r}"])
def test_prompt_builder_rejects_bad_templates_up_front(template: str) -> None:
    with pytest.raises(ValueError):
        PromptBuilder(template=template)


# ---------------------------------------------------------------------------------------
# input lines -> items


def test_read_items_classifies_every_kind_of_line() -> None:
    src = lines(
        '{"id": "a", "text": "good"}',
        "{not json",
        "",  # blank: skipped, but still counts as line 3
        '{"id": "b"}',  # no text
        "[1, 2]",
        b'{"text": "\xff\xfe"}\n',
        '{"text": "no id"}',
        '{"id": 1.5, "text": "x"}',
    )
    items = list(read_items(src, PromptBuilder()))
    got = [(it.line_no, it.id, it.error["type"] if it.error else None) for it in items]
    assert got == [
        (1, "a", None),
        (2, 2, INVALID_JSON),
        (4, "b", MISSING_FIELD),
        (5, 5, NOT_OBJECT),
        (6, 6, INVALID_UTF8),
        (7, 7, None),  # no id field: the line number is the id
        (8, 8, INVALID_ID),
    ]
    assert items[0].messages == [{"role": "user", "content": "good"}]
    assert "line 2" in items[1].error["message"]


def test_lines_python_cannot_read_are_error_rows_not_crashes() -> None:
    """Nesting too deep, an integer past Python's digit limit, a lone surrogate in the text:
    each is that line's error row; the job goes on (they used to stop it on every rerun)."""
    src = lines(
        "[" * 100_000,
        '{"id": ' + "9" * 5000 + ', "text": "x"}',
        '{"id": "s", "text": "a\\udc00b"}',
        '{"id": "ok", "text": "fine"}',
    )
    got = [(it.id, it.error["type"] if it.error else None) for it in read_items(src, PromptBuilder())]
    assert got == [(1, INVALID_JSON), (2, INVALID_JSON), ("s", "invalid_text"), ("ok", None)]


def test_read_items_skips_done_ids_and_strips_bom() -> None:
    src = ["\ufeff".encode() + b'{"id": 1, "text": "a"}\n', b'{"id": "1", "text": "b"}\n', b'{"id": 2, "text": "c"}\n']
    skipped = []
    items = list(read_items(src, PromptBuilder(), done={row_key(1)}, on_skip=skipped.append))
    # the integer id 1 is done; the string id "1" is a different row
    assert [it.id for it in items] == ["1", 2]
    assert [it.id for it in skipped] == [1]


def test_custom_id_field() -> None:
    items = list(read_items(lines('{"ticket": "T-9", "text": "x"}'), PromptBuilder(), id_field="ticket"))
    assert items[0].id == "T-9"


def write_file(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def test_count_rows_leaves_a_pipe_alone(tmp_path) -> None:
    from constrained_serve.extract.inputs import count_rows

    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    assert count_rows(fifo) is None  # reading it would leave nothing for the job
    write_file(str(tmp_path / "f"), b"a\n\nb\n")
    assert count_rows(str(tmp_path / "f")) == 2


# ---------------------------------------------------------------------------------------
# results -> rows. Results here are plain records with the Result fields the CLI reads.


def fake_result(text: str = "", json_value=None, finish: str = "stop", error=None, error_type=None):
    usage = SimpleNamespace(prompt_tokens=10, cached_tokens=4, completion_tokens=5, forced_tokens=2)
    return SimpleNamespace(
        text=text, json=json_value, finish_reason=finish, error=error, error_type=error_type, usage=usage
    )


def test_result_rows() -> None:
    ok = result_row("a", fake_result('{"x": 1}', {"x": 1}), json_output=True)
    assert ok == {
        "id": "a",
        "output": {"x": 1},
        "finish_reason": "stop",
        "usage": {"prompt_tokens": 10, "cached_tokens": 4, "completion_tokens": 5, "forced_tokens": 2},
    }
    text = result_row("b", fake_result("2024-01-02"), json_output=False)
    assert text["output"] == "2024-01-02"
    cut = result_row("c", fake_result('{"x": ', None, "length", "output truncated"), json_output=True)
    assert cut["error"] == {"type": TRUNCATED, "message": "output truncated", "text": '{"x": '}
    assert cut["finish_reason"] == "length"
    cut_text = result_row("c", fake_result("20", finish="length"), json_output=False)
    assert cut_text["error"]["type"] == TRUNCATED and "max-tokens" in cut_text["error"]["message"]
    too_long = result_row(
        "d", fake_result(finish="abort", error="prompt too long", error_type="PromptTooLongError"), json_output=True
    )
    assert too_long["error"] == {"type": "prompt_too_long", "message": "prompt too long"}
    bad = result_row(
        "e", fake_result("{}", finish="stop", error="does not parse", error_type="JSONDecodeError"), json_output=True
    )
    assert bad["error"]["type"] == "json_decode"
    bad = result_row(
        "e", fake_result("{}", finish="stop", error="does not parse", error_type="ValueError"), json_output=True
    )
    assert bad["error"]["type"] == "invalid_output"


def test_pydantic_output_is_the_model_dump() -> None:
    from pydantic import BaseModel

    class M(BaseModel):
        a: int

    r = fake_result('{"a": 1, "extra": 2}', {"a": 1, "extra": 2})
    r.parsed = M(a=1)
    assert result_row(1, r, json_output=True)["output"] == {"a": 1}

    from pydantic import Field

    class Aliased(BaseModel):  # the schema (and so the output) uses the aliases
        is_urgent: bool = Field(alias="isUrgent")

    r = fake_result('{"isUrgent": true}', {"isUrgent": True})
    r.parsed = Aliased(isUrgent=True)
    assert result_row(1, r, json_output=True)["output"] == {"isUrgent": True}


def test_truncation_says_which_limit() -> None:
    at_max = result_row("a", fake_result("20", finish="length"), json_output=False, max_tokens=5)
    assert "raise --max-tokens" in at_max["error"]["message"]
    at_context = result_row("a", fake_result("20", finish="length"), json_output=False, max_tokens=64)
    assert "context length" in at_context["error"]["message"] and "shorten" in at_context["error"]["message"]
    refused = result_row(
        "b", fake_result('{"a": 1}', {"a": 1}, "stop", "no", "OutputValidationError"), json_output=True
    )
    assert refused["error"]["type"] == "output_validation" and refused["error"]["text"] == '{"a": 1}'


def test_job_stats_summary() -> None:
    st = JobStats()
    st.add({"id": 1, "output": 1, "usage": {"completion_tokens": 7, "prompt_tokens": 3, "cached_tokens": 1}})
    st.add({"id": 2, "error": {"type": TRUNCATED}})
    st.add({"id": 3, "error": {"type": INVALID_JSON}})
    assert (st.ok, st.truncated, st.failed, st.rows) == (1, 1, 1, 3)
    s = st.summary()
    assert "1 ok, 1 failed, 1 truncated" in s and "valid rate: 33.3%" in s and "rows/s" in s


# ---------------------------------------------------------------------------------------
# merging: early error rows and engine results come out in input order


class EchoEngine:
    """A stand-in with generate_iter's contract (lazy pull, results in order): the output
    is the user message's length. Only the merge order is under test here."""

    def __init__(self) -> None:
        self.seen: list = []

    def generate_iter(self, prompts, params, *, chat, max_in_flight, **spec):
        assert chat is True
        window: list = []
        for msgs in prompts:  # read ahead like continuous batching does
            self.seen.append(msgs)
            window.append(msgs)
            if len(window) == max_in_flight:
                yield from (self._result(m) for m in window)
                window = []
        yield from (self._result(m) for m in window)

    @staticmethod
    def _result(msgs):
        n = len(msgs[-1]["content"])
        return fake_result(json.dumps({"n": n}), {"n": n})


@pytest.mark.parametrize("max_in_flight", [1, 3, 100])
def test_run_extract_keeps_input_order_around_error_rows(max_in_flight: int) -> None:
    src = lines(
        "oops",
        '{"id": "a", "text": "x"}',
        "oops",
        "oops",
        '{"id": "b", "text": "xy"}',
        '{"id": "c"}',
        '{"id": "d", "text": "xyz"}',
        "oops",
    )
    rows: list = []
    engine = EchoEngine()
    stats = run_extract(
        engine, read_items(src, PromptBuilder()), rows.append, None, {}, json_output=True, max_in_flight=max_in_flight
    )
    assert [r["id"] for r in rows] == [1, "a", 3, 4, "b", "c", "d", 8]
    assert [r["output"]["n"] for r in rows if "output" in r] == [1, 2, 3]
    assert len(engine.seen) == 3  # error lines never reach the engine
    assert (stats.ok, stats.failed) == (3, 5)


def test_resume_tells_an_id_less_line_from_the_explicit_id_of_the_same_number(tmp_path) -> None:
    """0-based ids and one broken line: the broken line 2 is written with id 2 (its line
    number), and the line with the explicit id 2 comes later. A run killed in between must
    not take that later line for done when it resumes."""
    src = lines('{"id": 0, "text": "a"}', "oops", '{"id": 1, "text": "bb"}', '{"id": 2, "text": "ccc"}')
    rows: list = []
    run_extract(EchoEngine(), read_items(src, PromptBuilder()), rows.append, None, {}, json_output=True)
    assert [(r["id"], r.get("line")) for r in rows] == [(0, None), (2, 2), (1, None), (2, None)]
    out = str(tmp_path / "out.jsonl")
    sinks = open_sinks(out)
    for row in rows[:2]:  # killed after two rows
        sinks.write(row)
    sinks.close()
    sinks = open_sinks(out)
    todo = list(read_items(src, PromptBuilder(), done=sinks.done))
    sinks.close()
    assert [(it.line_no, it.id) for it in todo] == [(3, 1), (4, 2)]


def test_a_repeated_id_is_run_and_resumed_by_its_line(tmp_path, caplog) -> None:
    """Two lines with the id "a": both are run, the second's row carries its line number, and
    a run killed after the first row resumes the second (it is not taken for done)."""
    src = lines('{"id": "a", "text": "x"}', '{"id": "b", "text": "xy"}', '{"id": "a", "text": "xyz"}')
    rows: list = []
    run_extract(EchoEngine(), read_items(src, PromptBuilder()), rows.append, None, {}, json_output=True)
    assert [(r["id"], r.get("line"), r["output"]["n"]) for r in rows] == [("a", None, 1), ("b", None, 2), ("a", 3, 3)]
    assert "line 3 repeats the id" in caplog.text
    out = str(tmp_path / "out.jsonl")
    sinks = open_sinks(out)
    sinks.write(rows[0])  # killed after the first row
    sinks.close()
    sinks = open_sinks(out)
    todo = list(read_items(src, PromptBuilder(), done=sinks.done))
    assert [(it.line_no, it.id) for it in todo] == [(2, "b"), (3, "a")]
    for row in rows[1:]:
        sinks.write(row)
    sinks.close()
    sinks = open_sinks(out)
    assert list(read_items(src, PromptBuilder(), done=sinks.done)) == []  # everything is done
    sinks.close()
