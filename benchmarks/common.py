"""Shared helpers for the benchmarks: workloads, machine description, medians, result files."""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"

TOPICS = [
    "a late parcel",
    "a broken laptop screen",
    "a double charge on a credit card",
    "a hotel booking",
    "a refund for shoes",
    "a slow internet connection",
    "a missing invoice",
    "a cancelled flight",
    "a noisy washing machine",
    "a password reset",
    "a damaged sofa",
    "a subscription renewal",
]
ASKS = [
    "Summarise the problem in two sentences.",
    "Write a polite reply to the customer.",
    "List the next three steps support should take.",
    "Explain what probably went wrong.",
    "Suggest a fair compensation and justify it.",
]


def chat_workload(n: int = 64, seed: int = 0) -> list[list[dict]]:
    """n chat requests with prompts of varied length (about 20 to 300 tokens)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        topic = rng.choice(TOPICS)
        details = " ".join(
            f"Detail {k}: the customer mentioned {rng.choice(TOPICS)} as well." for k in range(rng.randint(0, 12))
        )
        msg = f"A customer wrote to us about {topic}. {details} {rng.choice(ASKS)}"
        out.append([{"role": "user", "content": msg}])
    return out


def engine_parser(
    doc: str, *, repeats: int, n: int | None = None, max_tokens: int | None = None, dtype: bool = False
) -> argparse.ArgumentParser:
    """The options the CPU benchmarks of the engine share: --model, --repeats, --threads, and
    where given, the workload size (--n, --max-tokens) and --dtype."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the packaged SmolLM2)")
    ap.add_argument("--repeats", type=int, default=repeats, help="rounds; figures are medians over them")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    if n is not None:
        ap.add_argument("--n", type=int, default=n, help="requests")
    if max_tokens is not None:
        ap.add_argument("--max-tokens", type=int, default=max_tokens)
    if dtype:
        ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    return ap


def machine() -> dict:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    else:
        try:
            with open("/proc/cpuinfo") as f:
                info["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
        except (OSError, StopIteration):
            info["cpu"] = platform.processor()
    return info


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def read_bandwidth_gbs(gib: float = 1.0, repeats: int = 5) -> float:
    """Streaming read bandwidth: GB/s of a `sum` over a tensor far larger than the caches."""
    x = torch.ones(int(gib * (1 << 30)) // 4)
    x.sum()
    t, _ = timed(lambda: [x.sum() for _ in range(repeats)])
    return repeats * x.numel() * 4 / t / 1e9


def median(xs):
    return statistics.median(xs)


def per_round(num: list[float], den: list[float]) -> float:
    """Median of the per-round ratios num[k] / den[k]."""
    return median([x / y for x, y in zip(num, den)])


def measure_rounds(systems: dict[str, tuple], repeats: int) -> dict[str, dict]:
    """Run every system once per round, ``repeats`` rounds: slow drifts of a shared VM then
    hit all systems alike, and per-round ratios cancel them. systems: name -> (go, warm up?);
    go() returns (output tokens, valid-output rate or None)."""
    for go, warm in systems.values():
        if warm:  # first-call allocations; the slow baselines skip it (their first batch warms up)
            go()
    runs: dict[str, list] = {name: [] for name in systems}
    for k in range(repeats):
        for name, (go, _) in systems.items():
            runs[name].append(timed(go))
            t, (n, rate) = runs[name][-1]
            valid = "" if rate is None else f"  valid {rate * 100:5.1f}%"
            print(f"  round {k + 1}: {name:<40} {t:6.1f} s  {n / t:6.1f} tokens/s{valid}", flush=True)
    out = {}
    for name, rs in runs.items():
        out[name] = {
            "wall_s": median([t for t, _ in rs]),
            "tokens_per_s": median([n / t for t, (n, _) in rs]),
            "valid_rate": rs[-1][1][1],
            "runs": [t for t, _ in rs],
            "tokens_per_s_runs": [n / t for t, (n, _) in rs],
            "output_tokens": rs[-1][1][0],
        }
    return out


def source_env(**extra: str) -> dict[str, str]:
    """This process's environment for a subprocess that must import this tree's package
    (its ``src`` first on PYTHONPATH, before any the caller set), plus ``extra``."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def save(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    kind = "gpu" if torch.cuda.is_available() else "cpu"
    path = RESULTS / f"{time.strftime('%Y-%m-%d')}-{kind}-{name}.json"
    if path.exists():  # a second run the same day (or with --skip flags) keeps the first one's figures
        path = path.with_name(f"{path.stem}-{time.strftime('%H%M%S')}.json")
    payload = {"machine": machine(), **payload}
    path.write_text(json.dumps(payload, indent=2))
    return path
