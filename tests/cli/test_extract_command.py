"""``constrained-serve extract`` (extract_command.py) end to end, on the real default model
for most: set-up errors before any row, one row per input line in input order, resume, a
kill -9 then a rerun, stdin, and rows whose grammar runs away."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import time
from pathlib import Path

import jsonschema
import pytest

from constrained_serve.cli import main

from ..helpers import EXAMPLES, SHORT_SCHEMA, subprocess_env

SCHEMA = str(EXAMPLES / "extract.schema.json")
TICKETS = [json.loads(line) for line in open(EXAMPLES / "tickets.jsonl")]


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.fixture(scope="module")
def short_schema(tmp_path_factory) -> str:
    """A schema file the default model completes in ~15 tokens (the demo's takes ~150)."""
    path = tmp_path_factory.mktemp("schema") / "short.schema.json"
    path.write_text(json.dumps(SHORT_SCHEMA))
    return str(path)


# ---------------------------------------------------------------------------------------
# errors found before any row: exit 2, nothing loaded, nothing written


def test_setup_errors_exit_2_before_any_row(tmp_path, capsys) -> None:
    good = write_lines(tmp_path / "in.jsonl", [json.dumps({"id": 1, "text": "hi"})])
    out = tmp_path / "out.jsonl"
    bad_schema = tmp_path / "bad.schema.json"
    bad_schema.write_text('{"type": "object", "properties": {"n": {"type": "integr"}}}')
    not_json = tmp_path / "notjson.schema.json"
    not_json.write_text("{oops")
    cases = [
        (["extract", str(tmp_path / "missing.jsonl"), "-o", str(out), "--schema", SCHEMA], "cannot read input"),
        (["extract", str(good), "-o", str(out), "--schema", str(bad_schema)], "not a valid JSON Schema"),
        (["extract", str(good), "-o", str(out), "--schema", str(not_json)], "not valid JSON"),
        (["extract", str(good), "-o", str(out), "--schema", "no_such_module:Model"], "cannot import"),
        (["extract", str(good), "-o", str(out), "--schema", SCHEMA, "--regex", "a+"], "only one of"),
        (["extract", str(good), "-o", str(out), "--template", "{"], "bad --template"),
        (
            ["extract", str(good), "-o", str(out), "--repetition-penalty", "0"],
            "repetition_penalty must be a finite number > 0",
        ),
        (
            ["extract", str(good), "-o", str(out), "--schema", SCHEMA, "--model", str(tmp_path / "nope.gguf")],
            "cannot load",
        ),
        (["extract", str(good), "-o", str(good)], "is the input file"),
        (["extract", str(good), "-o", str(out), "--temperature", "nan"], "temperature must be a finite number"),
        (["extract", str(good), "-o", str(out), "--template", "{n:d}"], "format specs"),
        (["extract", str(good), "-o", str(out), "--device", "tpu"], "device must be"),
        (["extract", str(good), "-o", str(out), "--threads", "0", "-v"], "num_threads must be >= 1"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err, (argv, err)
        assert "cannot load" not in err or message == "cannot load", err  # device/dtype are not the model's fault
        assert not out.exists()  # a failed set-up leaves no empty output file behind
    assert read_rows(good) == [{"id": 1, "text": "hi"}]  # the input, untouched


def test_template_escapes_are_read_as_newline_and_tab() -> None:
    from constrained_serve.cli.extract_command import _unescape

    assert _unescape(r"Title: {t}\n{body}\tend \\n") == "Title: {t}\n{body}\tend \\n"


@pytest.mark.slow
def test_bad_grammar_is_refused_before_any_row(engine, tmp_path, capsys) -> None:
    src = write_lines(tmp_path / "in.jsonl", [json.dumps({"id": 1, "text": "hi"}), "not json"])
    grammar = tmp_path / "bad.lark"
    grammar.write_text("start: undefined_rule\n")
    out = tmp_path / "out.jsonl"
    assert main(["extract", str(src), "-o", str(out), "--grammar", str(grammar)], engine=engine) == 2
    assert "bad.lark" in capsys.readouterr().err
    assert read_rows(out) == []


# ---------------------------------------------------------------------------------------
# one row per line, in order, error rows for bad lines; rerun resumes


@pytest.mark.slow
def test_extract_one_row_per_line_in_order_then_resume(engine, short_schema, tmp_path, capsys) -> None:
    t = TICKETS
    lines = [
        json.dumps(t[0]),
        '{"id": "broken", "text": ',  # malformed JSON
        json.dumps({"id": "no-text", "body": "the text is under another key"}),
        json.dumps({"id": "huge", "text": "word " * (engine.max_model_len + 100)}),  # longer than the model
        "",  # blank lines are skipped
        json.dumps(t[2]),
    ]
    src = write_lines(tmp_path / "in.jsonl", lines)
    out, errs = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    argv = ["extract", str(src), "-o", str(out), "--schema", short_schema]
    assert main(argv + ["--max-tokens", "40"], engine=engine) == 0
    summary = capsys.readouterr().err
    rows = read_rows(out)
    assert [r["id"] for r in rows] == [t[0]["id"], 2, "no-text", "huge", t[2]["id"]]
    schema = json.loads(Path(short_schema).read_text())
    for row in (rows[0], rows[4]):
        if "error" in row:  # only a cut-off output may fail, and it must say so
            assert row["error"]["type"] == "truncated" and row["finish_reason"] == "length"
        else:
            jsonschema.validate(row["output"], schema)
            assert row["finish_reason"] == "stop"
            assert row["usage"]["completion_tokens"] > 0
    assert rows[1]["error"]["type"] == "invalid_json"
    assert rows[2]["error"]["type"] == "missing_field"
    assert rows[3]["error"]["type"] == "prompt_too_long" and rows[3]["finish_reason"] == "abort"
    assert "rows: 5 written" in summary and "valid rate" in summary and "rows/s" in summary

    # Rerun: everything is already there, nothing is regenerated or duplicated.
    before = out.read_bytes()
    assert main(argv, engine=engine) == 0
    assert out.read_bytes() == before
    assert "5 already done" in capsys.readouterr().err

    # --errors: error rows go to their own file; output keeps only the good rows.
    out2 = tmp_path / "out2.jsonl"
    argv = ["extract", str(src), "-o", str(out2), "--errors", str(errs), "--schema", short_schema, "--quiet"]
    assert main(argv + ["--max-tokens", "40"], engine=engine) == 0
    assert capsys.readouterr().err == ""
    assert all("output" in r for r in read_rows(out2))
    assert {r["id"] for r in read_rows(out2)} | {r["id"] for r in read_rows(errs)} == {
        t[0]["id"],
        2,
        "no-text",
        "huge",
        t[2]["id"],
    }


@pytest.mark.slow
def test_extract_with_regex_and_template(engine, tmp_path, capsys) -> None:
    src = write_lines(
        tmp_path / "in.jsonl",
        [json.dumps({"ref": "a", "city": "Paris", "country": "France"}), json.dumps({"ref": "b", "city": "Lima"})],
    )
    out = tmp_path / "out.jsonl"
    argv = [
        "extract",
        str(src),
        "-o",
        str(out),
        "--regex",
        "[A-Z][a-z]{2,11}",
        "--id-field",
        "ref",
        "--backend",
        "xgrammar",
        "--template",
        "In which country is {city}? ({country})",
        "--instructions",
        "Answer with one word.",
        "--max-tokens",
        "8",
        "--quiet",
    ]
    assert main(argv, engine=engine) == 0
    rows = read_rows(out)
    assert rows[0]["id"] == "a" and rows[0]["output"][0].isupper()
    assert rows[1] == {"id": "b", "error": {"type": "missing_field", "message": rows[1]["error"]["message"]}}


@pytest.mark.slow
def test_extract_with_an_imported_pydantic_model(engine, tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "shop_models.py").write_text(
        "from typing import Literal\n"
        "from pydantic import BaseModel, Field\n"
        "class Review(BaseModel):\n"
        "    product: str = Field(max_length=30)\n"
        "    stars: int = Field(ge=1, le=5)\n"
        "    verdict: Literal['buy', 'skip']\n"
    )
    monkeypatch.chdir(tmp_path)  # `module:Model` is imported from the working directory, like `python -m`
    src = write_lines(tmp_path / "in.jsonl", [json.dumps(TICKETS[2])])
    out = tmp_path / "out.jsonl"
    argv = ["extract", str(src), "-o", str(out), "--schema", "shop_models:Review", "--max-tokens", "64", "--quiet"]
    assert main(argv, engine=engine) == 0, capsys.readouterr().err
    [row] = read_rows(out)
    assert set(row["output"]) == {"product", "stars", "verdict"} and 1 <= row["output"]["stars"] <= 5
    assert main(["extract", str(src), "-o", str(out), "--schema", "shop_models:Nope"], engine=engine) == 2
    assert "has no attribute Nope" in capsys.readouterr().err


@pytest.mark.slow
def test_extract_reads_stdin(engine, tmp_path, monkeypatch, capsys) -> None:
    data = b'{"id": "x"}\nnot json\n{"id": "y", "text": 3}\n'
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(data)))
    out = tmp_path / "out.jsonl"
    argv = ["extract", "-", "-o", str(out), "--regex", "[0-9]", "--max-tokens", "4", "--quiet"]
    assert main(argv, engine=engine) == 0, capsys.readouterr().err
    rows = read_rows(out)
    assert [r["id"] for r in rows] == ["x", 2, "y"]
    assert rows[0]["error"]["type"] == "missing_field" and rows[1]["error"]["type"] == "invalid_json"
    assert rows[2]["output"].isdigit()  # a non-string field value is sent as its JSON text


# ---------------------------------------------------------------------------------------
# kill -9 mid-run, then rerun: exactly one row per input id


@pytest.mark.slow
def test_sigkill_then_rerun_gives_exactly_one_row_per_id(short_schema, tmp_path, python) -> None:
    lines = [json.dumps(t) for t in TICKETS[:14]]
    lines.insert(5, "{broken")  # an error row written by the first run
    src = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    argv = [
        python,
        "-m",
        "constrained_serve.cli",
        "extract",
        str(src),
        "-o",
        str(out),
        "--schema",
        short_schema,
        "--max-tokens",
        "40",
    ]
    # Small batches in the first run, so rows land a few at a time and there is a moment
    # with some rows written and some not; the rerun may batch differently.
    proc = subprocess.Popen(
        argv + ["--max-num-seqs", "2"], env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None and len(read_rows(out)) < 4:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed: " + proc.stderr.read().decode()[-2000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    first = read_rows(out)
    assert 4 <= len(first) < len(lines)
    with open(out, "ab") as f:  # what a write cut short by the kill would leave behind
        f.write(b'{"id": "T-0')

    done = subprocess.run(
        argv + ["--quiet", "--max-num-seqs", "16"], env=subprocess_env(), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_rows(out)
    expected = [json.loads(line)["id"] if line.startswith('{"id"') else 6 for line in lines]
    assert [r["id"] for r in rows] == expected  # one row per id, in input order, none lost
    assert rows[: len(first)] == first  # the first run's rows are kept as they were
    schema = json.loads(Path(short_schema).read_text())
    for row in rows:
        if "output" in row:
            jsonschema.validate(row["output"], schema)
        else:
            assert row["id"] == 6 or row["error"]["type"] == "truncated", row
    assert sum("output" in r for r in rows) >= len(rows) - 3


# ---------------------------------------------------------------------------------------
# a grammar that runs away: its rows become error rows, the others are written


# llguidance 1.9.1 spins for ever after "x" here (tests/grammar/test_worker.py); "q" or
# "r" ends the output.
HANG_AFTER_X = 'start: "q" | "r" | "x" y\ny: "{" A B "}"\nA: /a+/\nB: /a/\n'


@pytest.mark.timeout(240)
def test_rows_whose_grammar_runs_away_become_error_rows(tiny_engine_factory, tmp_path, capsys) -> None:
    eng = tiny_engine_factory(grammar_mask_timeout_s=0.4)
    grammar = tmp_path / "hang.lark"
    grammar.write_text(HANG_AFTER_X)
    src = write_lines(tmp_path / "in.jsonl", [json.dumps({"id": i, "text": f"Row {i}: q or x?"}) for i in range(12)])
    out = tmp_path / "out.jsonl"
    argv = [
        "extract",
        str(src),
        "-o",
        str(out),
        "--grammar",
        str(grammar),
        "--temperature",
        "1",
        "--seed",
        "3",
        "--max-tokens",
        "8",
    ]
    t0 = time.monotonic()
    assert main(argv, engine=eng) == 0
    assert time.monotonic() - t0 < 120
    rows = read_rows(out)
    assert sorted(r["id"] for r in rows) == list(range(12))  # one row per line, none lost
    errors = [r for r in rows if "error" in r]
    good = [r for r in rows if "error" not in r]
    assert errors and good, rows  # the seed makes some rows start with "x", the others not
    for r in errors:
        assert r["error"]["type"] == "grammar" and "deadline" in r["error"]["message"], r
    assert all(r["output"] in ("q", "r") and r["finish_reason"] == "stop" for r in good), good
    # A resume finds every row done: nothing hangs, nothing is redone.
    before = out.read_bytes()
    capsys.readouterr()
    assert main(argv, engine=eng) == 0
    assert out.read_bytes() == before and "12 already done" in capsys.readouterr().err


def test_grounded_rows_quote_their_text_and_carry_spans(tiny_engine_factory, tmp_path, capsys) -> None:
    """--grounded --spans on a random-weight model (it writes whatever the grammar allows):
    every string value is a verbatim span of its row's text, at the offsets its row says."""
    eng = tiny_engine_factory()
    schema = tmp_path / "s.json"
    schema.write_text(
        json.dumps(
            {
                "type": "object",
                "properties": {"who": {"type": "string", "maxLength": 20}, "mail": {"type": ["string", "null"]}},
                "required": ["who", "mail"],
            }
        )
    )
    texts = ['Zoë "Z" Müller\\n <zoe@acme.de> 😀', "Tom O'Brien, tom@x.io\ttab", "plain words twice, plain words"]
    src = write_lines(tmp_path / "in.jsonl", [json.dumps({"id": i, "text": t}) for i, t in enumerate(texts)])
    out = tmp_path / "out.jsonl"
    argv = ["extract", str(src), "-o", str(out), "--schema", str(schema), "--grounded", "--spans"]
    argv += ["--temperature", "1", "--seed", "5", "--max-tokens", "60"]
    assert main(argv, engine=eng) == 0, capsys.readouterr().err
    rows = read_rows(out)
    assert [r["id"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert "output" in r, r
        text = texts[r["id"]]
        for key, value in r["output"].items():
            assert value is None or value in text, (key, value, text)
            if value:
                start, end = r["spans"][f"$.{key}"]
                assert text[start:end] == value
