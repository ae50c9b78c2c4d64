"""Every example script runs on the default model and prints what it promises.

The demo runs as a user runs it, a process of its own. The other scripts run in this process
as ``__main__`` (runpy), their ``Engine()`` being the session's default-model engine
(conftest.shared_engine): the same code, without a Python, torch and model start each.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import runpy
import subprocess
import sys

import pytest

from ..helpers import EXAMPLES, subprocess_env

pytestmark = pytest.mark.slow


def run(python: str, script: str, *args: str) -> str:
    done = subprocess.run(
        [python, str(EXAMPLES / script), *args], env=subprocess_env(), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done.stdout + done.stderr


@pytest.fixture
def run_here(shared_engine, monkeypatch):
    """Run an example script as ``python examples/SCRIPT ARGS`` would, in this process."""

    def run_script(script: str, *args: str) -> str:
        out = io.StringIO()
        monkeypatch.setattr(sys, "argv", [str(EXAMPLES / script), *args])
        monkeypatch.syspath_prepend(str(EXAMPLES))  # as `python examples/SCRIPT` has it
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                runpy.run_path(str(EXAMPLES / script), run_name="__main__")
            except SystemExit as e:
                assert e.code in (None, 0), f"{script} exited {e.code}:\n{out.getvalue()[-4000:]}"
        return out.getvalue()

    return run_script


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


def test_pydantic_extraction(run_here) -> None:
    out = run_here("pydantic_extraction.py")
    assert out.count("-> Invoice(") + out.count("-> no Invoice (length)") == 3
    assert "Invoice(" in out


def test_regex(run_here) -> None:
    out = run_here("regex_patterns.py")
    assert len(re.findall(r"\(matches: True\)", out)) >= 5  # a cut-off output may not match; most must


def test_lark_grammar(run_here) -> None:
    out = run_here("lark_grammar.py")
    assert re.search(r"-> '.+' = -?[0-9.]+", out), out
    assert "SELECT" in out


def test_conversation(run_here) -> None:
    out = run_here("conversation.py", "--max-tokens", "24")
    cached = [int(x) for x in re.findall(r"(\d+) from cache", out)]
    assert len(cached) == 3 and cached[1] > 0 and cached[2] > cached[1]  # each turn reuses the history
    assert "7 messages in the history" in out


def test_batch_jsonl(run_here) -> None:
    out = run_here("batch_jsonl.py", "--limit", "6")
    assert re.search(r"\b[4-6]/6 rows valid; fields filled: \{", out), out
