"""Two source trees of this project, A/B, on the CPU benchmarks' workloads: is a change slower?

For a refactor that must not cost speed (issue #37's "not slower, within noise, measured in
one run against the tree before the change"): each tree's engine runs in its own process
(``PYTHONPATH=<tree>/src``, the tree's own ``benchmarks/`` for the workloads), both kept
alive, rounds alternating (before, after, before, after, ...) so a drifting shared VM slows
both alike, each round on a quiet machine. Workloads, our side of the peers' benchmarks:

- ``free``: vs_vllm_cpu.py's 64 chats (throughput.py's prompts), greedy, max_tokens 96;
- ``structured``: vs_vllm_cpu.py --mode structured: the 64 JSON extractions of structured.py
  under its schema (validity checked with jsonschema);
- ``cold``: ``free`` with the prefix cache cleared before every round (all prefill).

Figures: medians over --repeats rounds and the median per-round ratio of output tokens/s
(after / before; above 1 = after is faster).

    python benchmarks/tree_ab.py --before /path/to/old/checkout [--after .] [--repeats 3]
        [--workloads free,structured,cold] [--dtype float32|bfloat16]

Make a tree of the old commit with ``git worktree add /tmp/before <commit>``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# The worker: one engine of one tree; reads a workload name a line, answers one JSON line.
WORKER = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1] + "/benchmarks")
import torch
from common import chat_workload
from structured import SCHEMA, valid, workload
from constrained_serve import Engine, SamplingParams

threads, dtype = int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(threads)
engine = Engine(num_threads=threads, max_num_seqs=64, dtype=dtype)
params = SamplingParams(max_tokens=96)
free, structured = chat_workload(64), workload(64)
print(json.dumps({"ready": engine.config.model and str(engine.config.model) or "default"}), flush=True)
for line in sys.stdin:
    name = line.strip()
    if name == "quit":
        break
    if name == "cold" and engine.kv.radix is not None:
        engine.kv.radix.evict(engine.pool.num_pages)
    convs, spec = (structured, {"schema": SCHEMA}) if name == "structured" else (free, {})
    t = time.perf_counter()
    rs = engine.chat(convs, params, **spec)
    wall = time.perf_counter() - t
    out = {"wall_s": wall, "output_tokens": sum(r.usage.completion_tokens for r in rs)}
    if name == "structured":
        out["valid_rate"] = sum(valid(r.text) for r in rs) / len(rs)
    print(json.dumps(out), flush=True)
"""


class Tree:
    """One tree's engine process."""

    def __init__(self, label: str, root: Path, threads: int, dtype: str):
        self.label, self.root = label, root
        env = dict(os.environ, PYTHONPATH=str(root / "src"))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, str(root), str(threads), dtype],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=root,
        )
        self._answer()

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the {self.label} engine ({self.root}) exited with code {self.proc.wait()}")
        return json.loads(line)

    def run(self, workload: str) -> dict:
        self.proc.stdin.write(workload + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def git_head(root: Path) -> str:
    r = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "src"], capture_output=True, text=True)
    return r.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, type=Path, help="the old tree (a checkout or git worktree)")
    ap.add_argument("--after", default=HERE.parent, type=Path, help="the new tree (default: this checkout)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--workloads", default="free,structured,cold")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    from common import machine, median, per_round, save
    from driver_process import settle

    workloads = args.workloads.split(",")
    trees = [Tree("before", args.before.resolve(), args.threads, args.dtype)]
    trees.append(Tree("after", args.after.resolve(), args.threads, args.dtype))
    me = os.getpid()
    result: dict = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "commits": {t.label: git_head(t.root) for t in trees},
        "machine": machine(),
    }
    try:
        for w in workloads:
            for t in trees:  # warm-up: first-call allocations, the prefix cache filled
                settle(me)
                t.run(w)
            runs: dict[str, list[dict]] = {t.label: [] for t in trees}
            for k in range(args.repeats):
                for t in trees if k % 2 == 0 else trees[::-1]:
                    settle(me)
                    r = t.run(w)
                    runs[t.label].append(r)
                    v = f"  valid {r['valid_rate'] * 100:5.1f}%" if "valid_rate" in r else ""
                    print(
                        f"  {w:<10} round {k + 1}: {t.label:<6} {r['wall_s']:6.2f} s  {r['output_tokens']:5d} tokens  "
                        f"{r['output_tokens'] / r['wall_s']:6.1f} tok/s{v}",
                        flush=True,
                    )
            tps = {name: [r["output_tokens"] / r["wall_s"] for r in rs] for name, rs in runs.items()}
            result[w] = {
                name: {"tokens_per_s": median(tps[name]), "wall_s": median([r["wall_s"] for r in rs]), "rounds": rs}
                for name, rs in runs.items()
            }
            result[w]["ratio_after_over_before"] = per_round(tps["after"], tps["before"])
            print(
                f"{w}: before {result[w]['before']['tokens_per_s']:.1f} tok/s, after "
                f"{result[w]['after']['tokens_per_s']:.1f} tok/s, ratio {result[w]['ratio_after_over_before']:.3f}",
                flush=True,
            )
    finally:
        for t in trees:
            t.close()
    print("saved", save(f"tree-ab-{args.dtype}", result))


if __name__ == "__main__":
    main()
