"""Our engine and vLLM's CPU build on a busy machine: alone, beside spinning processes, and two
engines side by side.

Each system runs in processes of its own (`engine_driver.py`, `vllm_cpu_driver.py`), two of
each: A does the rounds, B joins A in the "pair" scenario (two engines at once, as two
notebooks or a test run beside a job would be). The scenarios, with the competitors this
script starts itself:

    quiet   A alone
    spin1   A beside one busy-looping process (`while True: pass`)
    spin2   A beside two
    pair    A and B at once, the same workload each; their output tokens over the longer wall

Workload: 64 chat requests (`common.chat_workload`), 48 output tokens each (ignore_eos, so
both systems produce exactly as many), greedy, fp32 (or --dtype), the default model, the same
prompt token ids for both (our chat template's rendering). Within a scenario, rounds alternate
(ours, vLLM, ours, ...); each starts once both systems' processes are idle. Figures are
medians over --repeats rounds.

Targets (#40): pair >= 0.9x the quiet figure; spin1 and spin2 >= the fair share of the quiet
figure (the cores left per competing process, C / (k + 1) of C: 1/2 and 1/3 on 2 cores); in
every scenario ours >= vLLM.

    python benchmarks/busy_machine.py [--repeats 3] [--scenarios quiet,pair,spin1,spin2]
                                      [--systems ours,vllm] [--dtype float32|bfloat16]
                                      [--ours-env KEY=VALUE ...] [--vllm-python PATH]
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import chat_workload, engine_parser, machine, median, save  # noqa: E402
from driver_process import DEFAULT_VLLM_PYTHON, VLLM, Driver, Ours, load, settle  # noqa: E402

from constrained_serve.models.loader import default_model_dir  # noqa: E402

SPINNERS = {"quiet": 0, "spin1": 1, "spin2": 2, "pair": 0}


def spinners(k: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(k)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def one_round(drivers: list[Driver]) -> dict:
    """Every driver runs the loaded workload at once; tokens over the longest wall."""
    for d in drivers:
        settle(d.proc.pid)
    t = time.perf_counter()
    for d in drivers:
        d.send(cmd="run")
    answers = [d.answer() for d in drivers]
    wall = time.perf_counter() - t
    tokens = sum(a["output_tokens"] for a in answers)
    return {
        "wall_s": wall,
        "output_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "each_tokens_per_s": [a["output_tokens"] / a["wall_s"] for a in answers],
        "threads": [a.get("threads") for a in answers],
        "tuner_switches": [a.get("tuner_switches") for a in answers],  # ours only: thread counts kept so far
        "load": load(),
    }


def main() -> None:
    ap = engine_parser(__doc__, repeats=3, n=64, max_tokens=48, dtype=True)
    ap.add_argument("--scenarios", default="quiet,pair,spin1,spin2")
    ap.add_argument("--systems", default="ours,vllm")
    ap.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    ap.add_argument("--ours-env", nargs="*", default=[], metavar="KEY=VALUE", help="environment of our drivers")
    ap.add_argument("--ours-extra", default="", help="more options for engine_driver.py, e.g. --fixed-threads")
    ap.add_argument("--logs", default="/tmp/busy_machine-logs", help="the drivers' log files")
    args = ap.parse_args()
    if args.model is not None:
        raise SystemExit("--model: this benchmark compares on the default model only (both load its HF folder)")
    scenarios = args.scenarios.split(",")
    systems = args.systems.split(",")
    if bad := [s for s in scenarios if s not in SPINNERS]:
        raise SystemExit(f"--scenarios: unknown {bad}; choose from {list(SPINNERS)}")
    if bad := [s for s in systems if s not in ("ours", "vllm")]:
        raise SystemExit(f"--systems: unknown {bad}; choose from ours, vllm")
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    ours_env = dict(kv.split("=", 1) for kv in args.ours_env)
    copies = 2 if "pair" in scenarios else 1
    print("load before:", load(), flush=True)

    drivers: dict[str, list[Driver]] = {}
    t0 = time.perf_counter()
    ours_extra = ["--dtype", args.dtype, *args.ours_extra.split()]
    ours = [Ours(args.threads, ours_extra, logs / f"ours{k}.log", ours_env) for k in range(copies)]
    if "ours" in systems:
        drivers["ours"] = ours
    if "vllm" in systems:
        model = default_model_dir()
        drivers["vllm"] = [
            VLLM(args.vllm_python, model, args.threads, ["--dtype", args.dtype], logs / f"vllm{k}.log")
            for k in range(copies)
        ]
    print(f"drivers up in {time.perf_counter() - t0:.0f} s (logs in {logs})", flush=True)
    prompts = ours[0].ask(cmd="encode_chat", conversations=chat_workload(args.n))["prompts"]
    for ds in drivers.values():
        for d in ds:
            d.ask(cmd="load", prompts=prompts, schema=None, max_tokens=args.max_tokens, ignore_eos=True)
            d.ask(cmd="run")  # warm-up: first-call allocations, both prefix caches filled
    if "ours" not in systems:
        for d in ours:
            d.close()

    result: dict = {"args": vars(args), "load_before": load(), "scenarios": {}}
    for sc in scenarios:
        spin = spinners(SPINNERS[sc])
        try:
            runs: dict[str, list[dict]] = {name: [] for name in drivers}
            for k in range(args.repeats):
                for name, ds in drivers.items():
                    r = one_round(ds if sc == "pair" else ds[:1])
                    runs[name].append(r)
                    each = "" if sc != "pair" else f"  (each {[round(x) for x in r['each_tokens_per_s']]})"
                    print(
                        f"  {sc:<6} round {k + 1}: {name:<5} {r['wall_s']:6.1f} s  {r['tokens_per_s']:6.1f} tokens/s"
                        f"{each}  threads {r['threads']}  load {r['load'][0]}",
                        flush=True,
                    )
        finally:
            stop(spin)
        result["scenarios"][sc] = {
            name: {"tokens_per_s": median([r["tokens_per_s"] for r in rs]), "rounds": rs} for name, rs in runs.items()
        }
    for ds in drivers.values():
        for d in ds:
            d.close()

    cores = os.cpu_count() or 1
    # A process's fair share beside k single-thread spinners: the cores they leave free, or
    # else an equal split among the k + 1 processes, over the C cores it had alone.
    targets = {sc: max(cores - k, cores / (k + 1)) / cores for sc, k in SPINNERS.items() if k}
    targets["pair"] = 0.9
    summary: dict = {}
    print(f"\nmedians over {args.repeats} rounds, output tokens/s, {cores} cores")
    print(f"{'scenario':<8}" + "".join(f"{n:>12}{'x quiet':>10}" for n in drivers) + "   ours/vLLM   target x quiet")
    for sc, by in result["scenarios"].items():
        row = f"{sc:<8}"
        summary[sc] = {}
        for name in drivers:
            tps = by[name]["tokens_per_s"]
            quiet = result["scenarios"].get("quiet", {}).get(name, {}).get("tokens_per_s")
            rel = tps / quiet if quiet else None
            summary[sc][name] = {"tokens_per_s": round(tps, 1), "x_quiet": None if rel is None else round(rel, 3)}
            row += f"{tps:12.1f}{'' if rel is None else f'{rel:10.2f}':>10}"
        if "ours" in by and "vllm" in by:
            per_round = median(
                [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(by["ours"]["rounds"], by["vllm"]["rounds"])]
            )
            summary[sc]["ours_over_vllm"] = round(per_round, 3)
            row += f"{per_round:12.2f}"
        else:
            row += f"{'':>12}"
        if sc in targets:
            row += f"   >= {targets[sc]:.2f}"
        print(row)
    result["summary"] = summary
    result["targets_x_quiet"] = targets
    result["load_after"] = load()
    print("machine:", machine())
    print("saved", save(f"busy_machine-{time.strftime('%H%M%S')}", result))


if __name__ == "__main__":
    main()
