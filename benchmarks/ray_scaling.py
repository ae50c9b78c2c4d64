"""Rows/s of the extraction job: the local CLI against ``extract --ray`` with 1 and N replicas.

Every system runs the same job (examples/tickets.jsonl repeated to --n rows, the example
schema, greedy, the default model) through ``constrained_serve.cli.main``, end to end: model
load included, and for Ray the actors' start (a Ray cluster, started once here, stands for
the user's running cluster). Rounds alternate the systems; figures are medians. Printed: the
scaling ratio (N replicas / 1 replica) and the overhead of 1 replica against the local job
(target: at most 10% slower).

CPU: N = 2 on a 2-core machine cannot scale (2 replicas of 1 thread each against 1 of 2
threads: the same cores). GPU: N = the number of GPUs, one per replica.

With ``--processes`` every run is a ``python -m constrained_serve.cli`` process instead (the
Ray runs joining the cluster started here with ``--ray-address``): what a user times with
``time constrained-serve extract ...``, where the local job pays the imports of torch and
the model code as a Ray replica does. In-process (the default), the local job finds them
imported already by this script, and a replica, a new process, does not.

    python benchmarks/ray_scaling.py [--n 72] [--repeats 3] [--max-tokens 96] [--batch-size B] [--processes]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import torch  # noqa: E402
from common import engine_parser, median, save, source_env  # noqa: E402

from constrained_serve.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "examples" / "extract.schema.json"


def workload(path: Path, n: int) -> None:
    tickets = [json.loads(line) for line in open(ROOT / "examples" / "tickets.jsonl")]
    with open(path, "w") as f:
        for i in range(n):
            t = tickets[i % len(tickets)]
            f.write(json.dumps({"id": f"{t['id']}-{i}", "text": t["text"]}) + "\n")


def run(argv: list[str], out: Path, processes: bool) -> tuple[float, int]:
    t = time.perf_counter()
    if processes:
        env = source_env()
        cmd = [sys.executable, "-m", "constrained_serve.cli"] + argv + ["-o", str(out), "-q"]
        done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
    else:
        assert main(argv + ["-o", str(out), "-q"]) == 0
    secs = time.perf_counter() - t
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return secs, sum("output" in r for r in rows)


def main_bench() -> None:
    ap = engine_parser(__doc__, repeats=3, n=72, max_tokens=96)
    ap.add_argument("--batch-size", type=int, default=None, help="--batch-size of the Ray runs (default: auto)")
    ap.add_argument("--processes", action="store_true", help="each run a CLI process (see above)")
    args = ap.parse_args()
    import ray

    gpus = torch.cuda.device_count()
    wide = max(gpus, 2)
    ray.init(include_dashboard=False, logging_level="ERROR", **({} if gpus else {"num_cpus": args.threads}))
    tmp = Path(tempfile.mkdtemp(prefix="ray_scaling"))
    src = tmp / "in.jsonl"
    workload(src, args.n)
    base = ["extract", str(src), "--schema", str(SCHEMA), "--max-tokens", str(args.max_tokens)]
    if args.model:
        base += ["--model", args.model]
    local = base + ([] if gpus else ["--threads", str(args.threads)])
    ray_args = base + ["--ray"] + (["--batch-size", str(args.batch_size)] if args.batch_size else [])
    if args.processes:
        ray_args += ["--ray-address", ray.get_runtime_context().gcs_address]
    systems = {
        "local": local,
        "ray_1": ray_args + ["--replicas", "1"] + (["--gpus-per-replica", "1"] if gpus else []),
        f"ray_{wide}": ray_args + ["--replicas", str(wide)] + (["--gpus-per-replica", "1"] if gpus else []),
    }
    runs: dict[str, list[tuple[float, int]]] = {name: [] for name in systems}
    for k in range(args.repeats):
        for name, argv in systems.items():
            out = tmp / f"{name}-{k}.jsonl"
            secs, ok = run(argv, out, args.processes)
            runs[name].append((secs, ok))
            load = os.getloadavg()[0]  # other work on the machine skews every figure: say how much
            print(
                f"  round {k + 1}: {name:<8} {secs:6.1f} s  {args.n / secs:6.2f} rows/s  ok {ok}/{args.n}  "
                f"load {load:.1f}",
                flush=True,
            )
    ray.shutdown()
    rows_s = {name: median([args.n / s for s, _ in rs]) for name, rs in runs.items()}
    per_round = lambda a, b: median([(args.n / x[0]) / (args.n / y[0]) for x, y in zip(runs[a], runs[b])])  # noqa: E731
    scaling = per_round(f"ray_{wide}", "ray_1")
    overhead = 1.0 - per_round("ray_1", "local")
    print("rows/s (median): " + ", ".join(f"{n} {v:.2f}" for n, v in rows_s.items()))
    print(
        f"scaling ray_{wide} / ray_1: {scaling:.2f}x"
        + ("" if gpus else f"  (CPU: {wide} replicas share the same {args.threads} cores, so no scaling is expected)")
    )
    print(f"overhead of ray_1 vs local: {overhead * 100:+.1f}% slower (target <= 10%)")
    path = save(
        "ray_scaling",
        {
            "args": vars(args),
            "rows_per_s": rows_s,
            "scaling": scaling,
            "overhead_vs_local": overhead,
            "replicas_wide": wide,
            "runs": {n: [{"wall_s": s, "ok": ok} for s, ok in rs] for n, rs in runs.items()},
        },
    )
    print(f"saved {path}")


if __name__ == "__main__":
    main_bench()
