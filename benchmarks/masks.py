"""Per-token mask fill time and compile time per grammar backend (MaskBench style).

For each JSONSchemaBench schema that compiles, every valid instance (serialized as the
engine writes it) is replayed token by token: before each token the matcher fills its
bitmask row (timed), then accepts the token. Single-row fills, one thread: this is the
per-request latency the engine's CPU side pays per decode step.

    python benchmarks/masks.py [--limit N] [--backend NAME]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import conformance as C  # noqa: E402
from common import save  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def summary(xs: list[float]) -> dict:
    return {"mean": statistics.fmean(xs), "p50": pct(xs, .5), "p99": pct(xs, .99), "max": max(xs)}


def bench(backend_name: str, files: list[Path], tok) -> dict:
    import json

    from constrained_serve.errors import GrammarError
    from constrained_serve.grammar import GrammarManager, make_output_spec

    mgr = GrammarManager(tok, len(tok), default_backend=backend_name, max_workers=1, cache_size=4)
    backend = mgr.backend(backend_name)
    bitmask = mgr.allocate_bitmask(1)
    compile_s: list[float] = []
    fill_s: list[float] = []
    first_fill_s: list[float] = []
    failed = 0
    for path in files:
        doc = json.loads(path.read_text())
        spec = make_output_spec(schema=doc["schema"])
        t0 = time.perf_counter()
        try:
            compiled = mgr.compile(spec)
        except GrammarError:
            failed += 1
            continue
        compile_s.append(time.perf_counter() - t0)
        for t in doc.get("tests", []):
            if not t["valid"]:
                continue
            ids = tok.encode(C.serialize(t["data"], doc["schema"]), add_special_tokens=False)
            m = backend.new_matcher(compiled)
            for i, token in enumerate(ids):
                t1 = time.perf_counter()
                m.fill_bitmask(bitmask, 0)
                dt = time.perf_counter() - t1
                fill_s.append(dt)
                if i == 0:
                    first_fill_s.append(dt)
                if not m.accept_tokens([token]):
                    break
    mgr.close()
    return {"compile": compile_s, "fill": fill_s, "first": first_fill_s, "failed": failed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=None,
                    help="N schema files spread evenly over the sorted list (so every split is sampled)")
    ap.add_argument("--backend", choices=C.BACKENDS, action="append")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    files = C.schema_files()
    if args.limit and args.limit < len(files):
        step = len(files) / args.limit
        files = [files[int(i * step)] for i in range(args.limit)]
    tok = C.load_default_tokenizer()
    rows, res = [], {"args": vars(args), "schema_files": len(files)}
    for name in args.backend or C.BACKENDS:
        t0 = time.perf_counter()
        r = bench(name, files, tok)
        rows.append((name, r, time.perf_counter() - t0))
    print(f"{len(files)} schema files; times in microseconds (fill) and milliseconds (compile)")
    print(f"{'backend':<11} {'tokens':>7} {'fill mean':>9} {'p50':>7} {'p99':>8} {'max':>9} {'1st p50':>8} |"
          f" {'compiled':>8} {'compile mean':>12} {'p50':>7} {'p99':>8} {'max':>8} | wall s")
    for name, r, wall in rows:
        f = [x * 1e6 for x in r["fill"]]
        c = [x * 1e3 for x in r["compile"]]
        first = [x * 1e6 for x in r["first"]]
        print(f"{name:<11} {len(f):7d} {statistics.fmean(f):9.1f} {pct(f, .5):7.1f} {pct(f, .99):8.1f} {max(f):9.1f}"
              f" {pct(first, .5):8.1f} | {len(c):8d} {statistics.fmean(c):12.2f} {pct(c, .5):7.2f}"
              f" {pct(c, .99):8.2f} {max(c):8.1f} | {wall:.0f}")
        res[name] = {"tokens": len(f), "fill_us": summary(f), "first_fill_us_p50": pct(first, .5),
                     "compiled": len(c), "failed": r["failed"], "compile_ms": summary(c), "wall_s": wall}
    print("saved", save("masks", res))


if __name__ == "__main__":
    main()
