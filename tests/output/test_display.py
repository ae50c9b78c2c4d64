"""HTML and text views of a Result (what Jupyter and repr() show)."""

from __future__ import annotations

from html.parser import HTMLParser

import pytest
from pydantic import BaseModel

from constrained_serve import Result, SamplingParams, Usage
from constrained_serve.output.display import result_repr_html, result_repr_text


class Ticket(BaseModel):
    title: str
    priority: int
    tags: list[str]


class _Collect(HTMLParser):
    """Collects tags and text, to check the HTML is well formed and nothing leaked."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.text: list[str] = []
        self.stack: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.stack.append(tag)

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, (self.stack, tag)
        self.stack.pop()

    def handle_data(self, data):
        self.text.append(data)


def parse(html: str) -> _Collect:
    p = _Collect()
    p.feed(html)
    p.close()
    assert p.stack == [], "unclosed tags"
    return p


def test_pydantic_result_is_a_table_with_usage() -> None:
    t = Ticket(title="Printer on fire", priority=1, tags=["hardware", "urgent"])
    r = Result(
        text=t.model_dump_json(),
        token_ids=[1, 2],
        finish_reason="stop",
        usage=Usage(prompt_tokens=30, cached_tokens=16, completion_tokens=12, forced_tokens=5),
        json=t.model_dump(),
        parsed=t,
    )
    page = parse(result_repr_html(r))
    assert "table" in page.tags and page.tags.count("tr") == 3
    text = "".join(page.text)
    for s in (
        "title",
        "Printer on fire",
        "priority",
        "hardware",
        "Ticket",
        "stop",
        "30 prompt",
        "16 cached",
        "12 generated",
        "5 forced",
    ):
        assert s in text, s
    line = result_repr_text(r)
    assert line.startswith("Result(Ticket({") and "finish_reason='stop'" in line and "16 cached" in line


def test_model_output_is_escaped() -> None:
    evil = "<script>alert('x')</script>&"
    r = Result(text=evil, token_ids=[], finish_reason="stop", parsed=evil)  # grammar output: parsed is the text
    page = parse(result_repr_html(r))
    assert "script" not in page.tags
    assert evil in "".join(page.text)  # shown literally
    r = Result(text="{}", token_ids=[], finish_reason="stop", json={"<b>key</b>": [evil]})
    page = parse(result_repr_html(r))
    assert page.tags.count("b") == 1 and "script" not in page.tags  # only our own label is bold
    assert "<b>key</b>" in "".join(page.text)


def test_truncated_and_error_results() -> None:
    r = Result(
        text='{"title": "Print',
        token_ids=[1],
        finish_reason="length",
        error="output truncated at max_tokens=8",
        error_type="truncated",
    )
    html = result_repr_html(r)
    text = "".join(parse(html).text)
    assert "length" in text and "truncated: output truncated" in text and '{"title": "Print' in text
    line = result_repr_text(r)
    assert "finish_reason='length'" in line and "truncated" in line
    assert repr(r) == line  # Result.__repr__ goes through display
    assert r._repr_html_() == html


def test_stop_reason_is_shown_and_escaped() -> None:
    r = Result(
        text="abc", token_ids=[1], finish_reason="stop", stop_reason="<b>}", error="output cut", error_type="truncated"
    )
    html = result_repr_html(r)
    assert "<b>}" not in html and "stop ('<b>}')" in "".join(parse(html).text)
    assert "stop_reason='<b>}'" in result_repr_text(r)
    assert "stop_reason" not in result_repr_text(Result(text="abc", token_ids=[1], finish_reason="stop"))


def test_long_and_nested_values_are_elided_not_dropped() -> None:
    value = {"rows": [{"n": i} for i in range(400)], **{f"k{i}": i for i in range(60)}}
    html = result_repr_html(Result(text="", token_ids=[], finish_reason="stop", json=value))
    assert "more characters" in html and "more fields" in html
    assert len(result_repr_text(Result(text="x" * 10_000, token_ids=[], finish_reason="stop"))) < 400


@pytest.mark.slow
def test_display_of_a_real_result(engine) -> None:
    [r] = engine.chat(
        [[{"role": "user", "content": "A ticket about a broken printer, as JSON."}]],
        SamplingParams(max_tokens=64),
        schema=Ticket,
    )
    html = r._repr_html_()
    parse(html)
    if r.parsed is not None:
        assert "Ticket" in html and "<table>" in html
    assert r.finish_reason in html and f"{r.usage.prompt_tokens} prompt" in html


def test_plain_json_schema_result_is_labelled_json() -> None:
    value = {"a": 1}
    r = Result(text='{"a": 1}', token_ids=[], finish_reason="stop", json=value, parsed=value)
    assert result_repr_text(r).startswith('Result({"a": 1}')
    assert "<b>json</b>" in result_repr_html(r)
