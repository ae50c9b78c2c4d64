"""One table of what a ``gpu_check.sh`` run measured against issue #20's targets, read from the
JSON files the checks leave in $OUT (default benchmarks/results/out). Markdown, so it can go
into RESULTS.md as it is; a figure a run did not produce shows as "-".

    python benchmarks/gpu_summary.py [DIR]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load(folder: Path) -> dict[str, dict]:
    out = {}
    for path in sorted(folder.glob("*.json")):
        try:
            out[path.stem] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    return out


def fmt(x, suffix: str = "") -> str:
    if x is None:
        return "-"
    return f"{x:g}{suffix}" if isinstance(x, (int, float)) and not isinstance(x, bool) else f"{x}{suffix}"


def rows(runs: dict[str, dict]) -> list[tuple[str, str, str]]:
    """(what, measured, target) rows."""
    table: list[tuple[str, str, str]] = []
    for name, r in runs.items():
        if name.startswith("gpu_correctness-"):
            paths = r.get("engine_paths", {})
            rates = {k: v.get("rate") for k, v in r.items() if isinstance(v, dict) and "rate" in v}
            table.append((f"correctness {name[16:]}", f"pass={r.get('pass')} rates={rates}", "fp32 1.0, bf16 >= 0.95"))
            table.append(
                (
                    f"  engine paths {name[16:]}",
                    ", ".join(f"{k}={fmt(v)}" for k, v in paths.items()),
                    "equal with cache, graphs, pipeline",
                )
            )
    for name in ("gpu_kernels", "gpu_kernels_smoke"):
        k = runs.get(name)
        if k is None:
            continue
        table.append(("kernel checks", f"{k.get('checks_passed')} passed, {k.get('checks_failed')} failed", "all pass"))
        targets = {
            "attention_decode": ("speedup_vs_sdpa_contiguous", ">= 0.9x SDPA"),
            "attention_prefill": ("speedup_vs_sdpa_contiguous", ">= 0.8x SDPA"),
            "sample_topk50_topp0.9": (
                "candidates_speedup_vs_torch_masked_topk_topp_multinomial",
                ">= 1x the torch chain",
            ),
        }
        for t in k.get("timings", []):
            key, target = targets.get(t.get("name"), (None, None))
            if key is None:
                continue
            shape = ", ".join(f"{a}={t[a]}" for a in ("batch", "ctx", "chunk") if a in t)
            table.append((f"{t['name']} {shape}", f"{fmt(t.get(key), 'x')} ({fmt(t.get('triton_ms'))} ms)", target))
    for name in ("gpu_kernels_sweep", "gpu_kernels_sweep_smoke"):
        for t in ("attention_prefill_sweep", "attention_decode_sweep"):
            timed = [x for x in runs.get(name, {}).get("timings", []) if x.get("name") == t and "triton_ms" in x]
            if timed:
                best = min(timed, key=lambda x: x["triton_ms"])
                names = ("block_m", "block_n", "num_warps", "num_stages", "num_splits")
                knobs = {a: best[a] for a in names if a in best}
                table.append((f"best {t}", f"{fmt(best.get('speedup_vs_sdpa_contiguous'), 'x')} SDPA at {knobs}", ""))
    e2e = {n: r for n, r in runs.items() if n.startswith("gpu_e2e-")}
    for name, r in e2e.items():
        eng = r.get("engine", {})
        bound = eng.get("bandwidth_bound", {})
        target = {"llama-3.2-1b": ">= 8x HF", "llama-3.1-8b": ">= 4x HF, >= 50% of bound"}.get(r.get("config"), "")
        table.append(
            (
                f"e2e {name[8:]}",
                f"{fmt(eng.get('output_tok_per_s'))} tok/s, {fmt(r.get('speedup_vs_hf'), 'x')} HF, "
                f"{fmt(eng.get('ms_per_step'))} ms/step, {fmt(bound.get('share_of_bound'))} of bound",
                target,
            )
        )
    for name, r in e2e.items():  # what the pipelined loop buys: the same run without it
        off = e2e.get(name + "-unpipelined")
        if off is not None:
            a, b = r.get("engine", {}).get("output_tok_per_s"), off.get("engine", {}).get("output_tok_per_s")
            if a and b:
                table.append((f"pipelined loop, {name[8:]}", f"{a / b:.2f}x the plain loop", "> 1"))
    for name, r in runs.items():
        if name.startswith("gpu_structured-"):
            table.append(
                (
                    f"structured {name[15:]}",
                    f"llguidance {fmt(r.get('ratio_llguidance_vs_unconstrained_median'), 'x')} unconstrained, "
                    f"xgrammar {fmt(r.get('ratio_xgrammar_vs_unconstrained_median'), 'x')}, "
                    f"{fmt(r.get('llguidance_vs_hf_xgrammar'), 'x')} HF+xgrammar, "
                    f"valid {fmt(r.get('llguidance_valid_min'))}",
                    ">= 0.9x, >= 3x HF, valid 1.0",
                )
            )
    return table


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    folder = Path(argv[0] if argv else os.environ.get("OUT", ROOT / "benchmarks" / "results" / "out"))
    runs = load(folder)
    if not runs:
        print(f"no JSON results in {folder}", file=sys.stderr)
        return 1
    print(f"| measured ({folder}) | figure | target |\n|---|---|---|")
    for what, measured, target in rows(runs):
        print(f"| {what} | {measured} | {target} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
