"""Where the time of a step goes, and what bounds structured.py's (a)/(b) tokens/s ratio.

Runs structured.py's workload through our engine, (a) constrained and (b) unconstrained, and
records every step's forward inputs and wall time. It then replays two recorded forwards, a
prefill-heavy step of (a) (512 tokens: new prompts plus the rows already decoding) and a
64-row decode step of (b), several times each, with parts of the model switched off:

- ``full``: the forward as it runs;
- ``no_attention``: paged attention returns an uninitialised tensor (the GEMMs and
  elementwise ops still run on the same shapes);
- ``gemms_only``: attention, the KV store, rotary, the norms and the MLP's SiLU*up are all
  skipped, so only the projections, the LM head and the embedding lookup remain.

The outputs of the ablated replays are garbage: the replays only time shapes. The KV they
write (past layer 0 with attention off) is garbage too, so the prefix cache is emptied after
the replays and nothing reads those pages again.

From the per-step trace it prints each run's time in prefill-heavy and in light steps, and
the (a)/(b) output-tokens/s ratio that would follow if the prefill-heavy steps ran at
``gemms_only`` speed, an optimistic bound for any attention or elementwise work on prefill.

    python benchmarks/step_breakdown.py [--repeats 7] [--threads 2] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import engine_parser, median, save, timed  # noqa: E402
from structured import run_ours, workload  # noqa: E402

from constrained_serve import Engine, SamplingParams  # noqa: E402
from constrained_serve.kernels import dispatch  # noqa: E402
from constrained_serve.models import llama  # noqa: E402

PREFILL_HEAVY = 256  # a step with more new tokens than this counts as prefill-heavy


def snapshot(inputs):
    """A copy of a step's forward inputs that later steps cannot change: the runner stages
    them in buffers it reuses (runtime/input_staging.py), so a kept reference would replay
    whatever a later step wrote there (positions past the rotary table, other rows)."""
    m = inputs.meta
    meta = dataclasses.replace(
        m,
        query_start_loc=m.query_start_loc.clone(),
        seq_lens=m.seq_lens.clone(),
        block_tables=m.block_tables.clone(),
        slot_mapping=m.slot_mapping.clone(),
        query_lens_host=list(m.query_lens_host),
        seq_lens_host=list(m.seq_lens_host),
        plan_cache={},
    )
    return dataclasses.replace(
        inputs,
        input_ids=inputs.input_ids.clone(),
        positions=inputs.positions.clone(),
        logits_indices=inputs.logits_indices.clone(),
        meta=meta,
        prompt_rows=[],
    )


def record(engine: Engine, convs, constrained: bool) -> tuple[float, int, list[tuple[object, float]]]:
    """One run of structured.py's (a) or (b); returns wall time, output tokens and
    (forward inputs, step seconds) per step."""
    core, steps = engine.core, []
    forward, step = core.runner.forward, core.step
    last = {}

    def recording_forward(inputs):
        last["inputs"] = snapshot(inputs)
        return forward(inputs)

    def timed_step():
        t = time.perf_counter()
        done = step()
        if "inputs" in last:
            steps.append((last.pop("inputs"), time.perf_counter() - t))
        return done

    core.runner.forward, core.step = recording_forward, timed_step
    try:
        wall, (tokens, _) = timed(run_ours(engine, convs, SamplingParams(max_tokens=96), constrained))
    finally:
        core.runner.forward, core.step = forward, step
    return wall, tokens, steps


def _no_attention():
    dispatch.paged_attention = lambda q, k_cache, v_cache, meta, scale: torch.empty_like(q)


def _gemms_only():
    _no_attention()
    dispatch.store_kv = lambda *args: None
    llama.RotaryEmbedding.apply = staticmethod(lambda cos_sin, q, k: (q, k))
    llama.RMSNorm.forward = lambda self, x: x
    llama.MLP.forward = lambda self, x: self.down_proj(self.gate_up_proj(x)[:, : self.inter])


ABLATIONS = {"full": lambda: None, "no_attention": _no_attention, "gemms_only": _gemms_only}


def replay(engine: Engine, inputs, repeats: int) -> dict[str, float]:
    """Median seconds of one forward under each ablation (interleaved, so drift hits all)."""
    attention, store, rotary = dispatch.paged_attention, dispatch.store_kv, llama.RotaryEmbedding.apply
    norm, mlp = llama.RMSNorm.forward, llama.MLP.forward

    def restore():
        dispatch.paged_attention, dispatch.store_kv = attention, store
        llama.RotaryEmbedding.apply = staticmethod(rotary)
        llama.RMSNorm.forward, llama.MLP.forward = norm, mlp

    times = {name: [] for name in ABLATIONS}
    try:
        for _ in range(repeats):
            for name, ablate in ABLATIONS.items():
                ablate()
                t = time.perf_counter()
                engine.core.runner.forward(inputs)
                times[name].append(time.perf_counter() - t)
                restore()
    finally:
        restore()
    return {name: median(ts) for name, ts in times.items()}


def split(steps) -> dict[str, float]:
    is_heavy = [i.input_ids.shape[0] - i.meta.query_lens_host.count(1) > PREFILL_HEAVY for i, _ in steps]
    heavy = [x for x, h in zip(steps, is_heavy) if h]
    light = [x for x, h in zip(steps, is_heavy) if not h]
    return {
        "steps": len(steps),
        "prefill_heavy_steps": len(heavy),
        "prefill_heavy_s": sum(s for _, s in heavy),
        "prefill_heavy_tokens": sum(int(i.input_ids.shape[0]) for i, _ in heavy),
        "light_steps": len(light),
        "light_s": sum(s for _, s in light),
    }


def main() -> None:
    ap = engine_parser(__doc__, repeats=7, dtype=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(model=args.model, num_threads=args.threads, max_num_seqs=64, dtype=args.dtype)
    convs = workload(64)
    record(engine, convs, True)  # warm-up: grammar compile, oneDNN primitives
    wall_a, tokens_a, steps_a = record(engine, convs, True)
    wall_b, tokens_b, steps_b = record(engine, convs, False)

    heavy = next(i for i, _ in steps_a if i.input_ids.shape[0] == 512)
    decode = next((i for i, _ in steps_b if i.meta.query_lens_host.count(1) == 64), None)
    if decode is None:
        raise SystemExit("no 64-row decode step in (b): the workload changed?")
    payload = {"dtype": args.dtype, "threads": args.threads, "repeats": args.repeats, "replays": {}}
    for name, inputs in (("prefill_heavy_512", heavy), ("decode_64", decode)):
        t = replay(engine, inputs, args.repeats)
        if engine.kv.radix is not None:
            engine.kv.radix.evict(engine.pool.num_pages)  # the ablated replays wrote garbage KV
        full = t["full"]
        shares = {"attention": (full - t["no_attention"]) / full, "gemms": t["gemms_only"] / full}
        shares["other"] = 1 - shares["attention"] - shares["gemms"]
        payload["replays"][name] = {"seconds": t, "shares": shares}
        print(
            f"{name}: full {full * 1e3:.0f} ms, no attention {t['no_attention'] * 1e3:.0f} ms, "
            f"GEMMs only {t['gemms_only'] * 1e3:.0f} ms -> attention {shares['attention']:.0%}, "
            f"GEMMs {shares['gemms']:.0%}, the rest {shares['other']:.0%}"
        )

    runs = {"a": (wall_a, tokens_a, split(steps_a)), "b": (wall_b, tokens_b, split(steps_b))}
    for name, (wall, tokens, s) in runs.items():
        print(
            f"({name}) {wall:.2f} s, {tokens} output tokens, {tokens / wall:.1f} tok/s; "
            f"{s['prefill_heavy_steps']} prefill-heavy steps {s['prefill_heavy_s']:.2f} s, "
            f"{s['light_steps']} light steps {s['light_s']:.2f} s"
        )
    ratio = (tokens_a / wall_a) / (tokens_b / wall_b)
    # Bound: every prefill-heavy step of both runs at the GEMM-only fraction of the 512-token replay.
    cut = 1 - payload["replays"]["prefill_heavy_512"]["shares"]["gemms"]
    bound_a = wall_a - cut * runs["a"][2]["prefill_heavy_s"]
    bound_b = wall_b - cut * runs["b"][2]["prefill_heavy_s"]
    bound = (tokens_a / bound_a) / (tokens_b / bound_b)
    # One run of each is noisy (+-20% on a shared VM); the multiplier is the steadier figure.
    print(
        f"(a)/(b) tokens/s, this one run: {ratio:.2f}x; with prefill-heavy steps at GEMM-only speed: "
        f"{bound:.2f}x, i.e. {bound / ratio:.2f} times the ratio"
    )
    payload.update(
        runs={k: {"wall_s": w, "output_tokens": n, **s} for k, (w, n, s) in runs.items()},
        ratio_a_over_b=ratio,
        ratio_bound_gemm_only_prefill=bound,
        bound_multiplier=bound / ratio,
    )
    print("saved", save(f"step-breakdown-{args.dtype}", payload))


if __name__ == "__main__":
    main()
