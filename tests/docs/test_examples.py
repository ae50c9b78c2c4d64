"""Every example script runs on the default model and prints what it promises."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from ..helpers import EXAMPLES, subprocess_env

pytestmark = pytest.mark.slow


def run(python: str, script: str, *args: str) -> str:
    done = subprocess.run(
        [python, str(EXAMPLES / script), *args], env=subprocess_env(), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done.stdout + done.stderr


def test_demo(python, tmp_path) -> None:
    out = run(python, "demo.py", "--limit", "6", "--out-dir", str(tmp_path))
    rows = [json.loads(line) for line in (tmp_path / "tickets.out.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["I-101", "T-102", "R-103", "E-104", "T-105", "I-106"]  # the test rows
    assert "valid rate" in out and "rows/s" in out and "->" in out
    # every demo row is labelled (tickets_test.jsonl "expected"); the demo scores both runs against it
    assert re.search(r"grounded: \d+/36 fields exactly right \(\d+%\)", out), out
    assert re.search(r"ungrounded: \d+/36 fields exactly right", out), out
    m = re.search(r"(\d+)/(\d+) grounded values are verbatim spans", out)
    # the shaped fields of these rows have values in their text: the grounded run writes them,
    # and every one quotes its text
    assert m is not None and int(m.group(1)) > 0 and m.group(1) == m.group(2), out
    assert (tmp_path / "tickets.ungrounded.out.jsonl").exists()


def test_pydantic_extraction(python) -> None:
    out = run(python, "pydantic_extraction.py")
    assert out.count("-> Invoice(") + out.count("-> no Invoice (length)") == 3
    assert "Invoice(" in out


def test_regex(python) -> None:
    out = run(python, "regex_patterns.py")
    assert len(re.findall(r"\(matches: True\)", out)) >= 5  # a cut-off output may not match; most must


def test_lark_grammar(python) -> None:
    out = run(python, "lark_grammar.py")
    assert re.search(r"-> '.+' = -?[0-9.]+", out), out
    assert "SELECT" in out


def test_conversation(python) -> None:
    out = run(python, "conversation.py", "--max-tokens", "24")
    cached = [int(x) for x in re.findall(r"(\d+) from cache", out)]
    assert len(cached) == 3 and cached[1] > 0 and cached[2] > cached[1]  # each turn reuses the history
    assert "7 messages in the history" in out


def test_batch_jsonl(python) -> None:
    out = run(python, "batch_jsonl.py", "--limit", "6")
    assert re.search(r"\b[4-6]/6 rows valid", out), out
