"""``constrained-serve extract`` while it works: Ctrl-C from a terminal (SIGINT to the whole
process group, grammar workers included) stops the job within seconds, keeps every row
written, says how to resume, and prints no alarm; and the progress line moves while rows
are still decoding."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..helpers import subprocess_env


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_ctrl_c_stops_at_once_keeps_rows_and_says_how_to_resume(tiny_llama_dir, tmp_path) -> None:
    n = 40
    src = tmp_path / "in.jsonl"
    lines = [json.dumps({"id": f"r{i}", "text": f"row {i}: a note about item {i}"}) for i in range(n)]
    src.write_text("".join(line + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    argv = [sys.executable, "-m", "constrained_serve.cli", "extract", str(src), "-o", str(out)]
    # Any JSON object (the default constraint): the grammar workers run. One row in flight,
    # so rows land one by one and there is a moment with some written and most not.
    argv += ["--model", str(tiny_llama_dir), "--max-tokens", "24", "--max-in-flight", "1", "--threads", "1"]
    # A new session, signalled as a terminal's Ctrl-C is: SIGINT to every process of the group.
    proc = subprocess.Popen(
        argv, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None and len(read_rows(out)) < 4:
            time.sleep(0.05)
        assert proc.poll() is None, "the job ended before Ctrl-C: " + proc.stderr.read().decode()[-2000:]
        # Grammar workers are forked by a fork server, a child of the job (or started by
        # the job itself where it cannot fork them): its descendants.
        workers = [p for p in _descendants(proc.pid) if b"constrained_serve.grammar" in _cmdline(p)]
        assert workers, "no grammar worker process: the test would not test their Ctrl-C"
        seen = len(read_rows(out))
        pressed = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        _, err_bytes = proc.communicate(timeout=60)
        took = time.monotonic() - pressed
    finally:
        if proc.poll() is None:
            proc.kill()
    err = err_bytes.decode()
    assert proc.returncode == 130, err
    assert took < 5.0, f"Ctrl-C took {took:.1f} s to stop the job"  # measured 1-2 s on 2 busy cores
    rows = read_rows(out)
    assert seen <= len(rows) < n  # every row written before the press is kept
    assert "to resume, rerun the same command" in err and str(out) in err
    assert f"{len(rows)} rows written in this run" in err
    for noise in ("worker died", "Traceback", "Connection reset", "press it again"):
        assert noise not in err, err

    # The command it prints finishes the job: one row per input line, in order.
    done = subprocess.run(argv + ["-q"], env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [r["id"] for r in read_rows(out)] == [f"r{i}" for i in range(n)]


def _descendants(pid: int) -> list[int]:
    parents = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out, frontier = [], {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier}
        out += sorted(frontier)
    return out


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_progress_moves_while_rows_decode(tiny_engine_factory) -> None:
    """The progress line reads the engine's rows in flight and their tokens: before any row
    is written it shows tokens, rows in flight, a partly filled bar and an ETA bound; then
    the rows, with an ETA from the tokens rows took."""
    from constrained_serve import SamplingParams
    from constrained_serve.cli.progress import ExtractProgress

    eng = tiny_engine_factory()
    long, short = SamplingParams(max_tokens=40, ignore_eos=True), SamplingParams(max_tokens=8, ignore_eos=True)
    progress = ExtractProgress(total=6, done_before=0, max_tokens=40, activity=eng.driver.activity)
    try:
        streams = [eng.stream(f"prompt {i}", long) for i in range(5)]
        for s in streams:  # each first delta adds its request and steps every row so far
            next(s)
        in_flight, tokens = eng.driver.activity()
        assert in_flight == 5 and 5 <= tokens < 5 * 40
        progress.refresh()
        assert f"{tokens} tok" in progress.text and "5 in flight" in progress.text, progress.text
        assert "0/6 rows" in progress.text and "ETA <=" in progress.text, progress.text  # a bound: no row measured
        assert 0 < progress.fraction < 5 / 6  # moved before any row was written
        [done] = eng.generate(["a short one"], short)
        progress.row({"id": 0, "output": {}, "usage": {"completion_tokens": done.usage.completion_tokens}})
        assert "1/6 rows" in progress.text and "ETA <=" not in progress.text and "ETA " in progress.text
        for s in streams:
            "".join(s)
        assert eng.driver.activity() == (0, 0)
    finally:
        progress.close()
