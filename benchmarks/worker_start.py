"""The first xgrammar request of an engine: grammar workers forked from the fork server
against workers spawned afresh (CONSTRAINED_SERVE_FORK_SERVER=0), in the same run.

Each round is a fresh process per mode, alternating: ``Engine()`` on the default model, then
the wall time of one xgrammar request (its compile worker and mask worker start first), then
the same on a second ``Engine`` in that process (whose workers a per-process server forks).
Prints the medians and the ratios forked / spawned.

    python benchmarks/worker_start.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import median, save, source_env  # noqa: E402

ROUND = r"""
import json, time
from constrained_serve import Engine, SamplingParams
grammar = 'start: "q" | "x" y\ny: "{" y? "}"'
out = {}
for name in ("first_engine_s", "second_engine_s"):
    engine = Engine(num_threads=1)
    t = time.perf_counter()
    engine.generate(["x"], SamplingParams(max_tokens=6), grammar_backend="xgrammar", grammar=grammar)
    out[name] = time.perf_counter() - t
print(json.dumps(out))
"""


def one_round(fork_server: bool) -> dict[str, float]:
    env = source_env(CONSTRAINED_SERVE_FORK_SERVER="1" if fork_server else "0", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", ROUND], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rounds: dict[str, list[dict[str, float]]] = {"forked": [], "spawned": []}
    for _ in range(args.repeats):
        for mode in rounds:
            rounds[mode].append(one_round(mode == "forked"))
    result: dict = {"rounds": rounds}
    for key in ("first_engine_s", "second_engine_s"):
        f = median([r[key] for r in rounds["forked"]])
        s = median([r[key] for r in rounds["spawned"]])
        result[key] = {"forked": f, "spawned": s, "ratio": f / s}
        print(f"{key}: forked {f:.2f} s, spawned {s:.2f} s, ratio {f / s:.2f}")
    print("saved", save("worker_start", result))


if __name__ == "__main__":
    main()
