"""Per-token mask fill time and compile time per grammar backend (MaskBench style), and what
running the grammar engines in killable worker processes costs per mask.

For each JSONSchemaBench schema that compiles, every valid instance (serialized as the
engine writes it) is replayed token by token: before each token the matcher fills its
bitmask row (timed), then accepts the token. Three ways, same schemas and tokens:

- ``direct``: the backend's matcher called in this process (what the engine did before the
  grammar work moved into worker processes; no deadline can stop it);
- ``inline``: through ``GrammarManager(isolation="inline")`` (the manager's bookkeeping, no process);
- ``process``: through the default ``GrammarManager`` (a round trip to the mask worker, under
  the per-mask deadline): the engine's path.

Then the per-step figure the engine pays: ``--rows`` matchers at different positions filled in
one call (one round trip), process vs inline.

    python benchmarks/masks.py [--limit N] [--backend NAME] [--rows R]
"""

from __future__ import annotations

import argparse
import json
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
    return {"mean": statistics.fmean(xs), "p50": pct(xs, 0.5), "p99": pct(xs, 0.99), "max": max(xs)}


def cases(files: list[Path], tok) -> list[tuple[dict, list[list[int]]]]:
    out = []
    for path in files:
        doc = json.loads(path.read_text())
        runs = [
            tok.encode(C.serialize(t["data"], doc["schema"]), add_special_tokens=False)
            for t in doc.get("tests", [])
            if t["valid"]
        ]
        out.append((doc["schema"], runs))
    return out


def bench_direct(backend_name: str, work, tok) -> dict:
    from constrained_serve.errors import GrammarError
    from constrained_serve.grammar import make_output_spec
    from constrained_serve.grammar.base import allocate_bitmask
    from constrained_serve.grammar.host import make_backend
    from constrained_serve.grammar.tokenizer_data import TokenizerData

    data = TokenizerData.from_hf(tok, len(tok))
    if backend_name == "xgrammar":
        data = data.with_xgrammar_info(tok)
    backend = make_backend(backend_name, data)
    bitmask = allocate_bitmask(1, len(tok))
    compile_s, fill_s, failed = [], [], 0
    for schema, runs in work:
        t0 = time.perf_counter()
        try:
            compiled = backend.compile(make_output_spec(schema=schema))
        except GrammarError:
            failed += 1
            continue
        compile_s.append(time.perf_counter() - t0)
        for ids in runs:
            m = backend.new_matcher(compiled)
            for token in ids:
                t1 = time.perf_counter()
                m.fill_bitmask(bitmask, 0)
                fill_s.append(time.perf_counter() - t1)
                if not m.accept_tokens([token]):
                    break
    return {"compile": compile_s, "fill": fill_s, "failed": failed}


def bench_manager(backend_name: str, work, tok, isolation: str, rows: int) -> dict:
    from constrained_serve.errors import GrammarError
    from constrained_serve.grammar import GrammarManager, make_output_spec

    mgr = GrammarManager(
        tok,
        len(tok),
        default_backend=backend_name,
        max_workers=1,
        mask_threads=1,
        cache_size=8,
        isolation=isolation,
        max_rows=max(rows, 1),
    )
    mgr.warm_up(backend_name).result()
    bitmask = mgr.step_bitmask(max(rows, 1))
    fill_s, step_s, failed = [], [], 0
    batch: list = []  # (handle, remaining tokens) for the per-step figure
    for schema, runs in work:
        try:
            compiled = mgr.compile(make_output_spec(schema=schema))
        except GrammarError:
            failed += 1
            continue
        for ids in runs:
            h = mgr.new_matcher(compiled)
            for token in ids:
                t1 = time.perf_counter()
                mgr.fill_bitmask([(0, h)], bitmask)
                fill_s.append(time.perf_counter() - t1)
                [a] = mgr.advance([(h, [token], 0, ())])
                if a is None or not a.accepted:
                    break
            if rows and len(ids) > 4:
                batch.append((mgr.new_matcher(compiled), list(ids)))
        while len(batch) >= rows > 0:  # one step of `rows` matchers: one fill, one advance
            group, batch = batch[:rows], batch[rows:]
            while group:
                t1 = time.perf_counter()
                mgr.fill_bitmask([(i, h) for i, (h, _) in enumerate(group)], bitmask)
                out = mgr.advance([(h, [ids[0]], 0, ()) for h, ids in group])
                step_s.append(time.perf_counter() - t1)
                group = [
                    (h, ids[1:]) for (h, ids), a in zip(group, out) if a is not None and a.accepted and len(ids) > 1
                ]
    stats = dict(mgr.stats)
    mgr.close()
    return {"fill": fill_s, "step": step_s, "failed": failed, "stats": stats}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--limit",
        type=int,
        default=None,
        help="N schema files spread evenly over the sorted list (so every split is sampled)",
    )
    ap.add_argument("--backend", choices=C.BACKENDS, action="append")
    ap.add_argument("--rows", type=int, default=32, help="matchers per step for the per-step figure (0: skip)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    files = C.schema_files()
    if args.limit and args.limit < len(files):
        step = len(files) / args.limit
        files = [files[int(i * step)] for i in range(args.limit)]
    tok = C.load_default_tokenizer()
    work = cases(files, tok)
    res = {"args": vars(args), "schema_files": len(files)}
    print(f"{len(files)} schema files; fill times in microseconds per mask, compile in milliseconds")
    print(f"{'backend':<11} {'path':<8} {'masks':>7} {'mean':>8} {'p50':>7} {'p99':>8} {'max':>9} | notes")
    for name in args.backend or C.BACKENDS:
        direct = bench_direct(name, work, tok)
        inline = bench_manager(name, work, tok, "inline", args.rows)
        process = bench_manager(name, work, tok, "process", args.rows)
        r = res[name] = {}
        for label, x in (("direct", direct), ("inline", inline), ("process", process)):
            f = [v * 1e6 for v in x["fill"]]
            r[label] = {"masks": len(f), "fill_us": summary(f)}
            note = ""
            if label == "direct":
                c = [v * 1e3 for v in x["compile"]]
                r["compile_ms"] = summary(c)
                r["compiled"], r["failed"] = len(c), x["failed"]
                note = f"compile mean {statistics.fmean(c):.2f} ms, p99 {pct(c, 0.99):.1f} ms ({len(c)} compiled)"
            print(
                f"{name:<11} {label:<8} {len(f):7d} {statistics.fmean(f):8.1f} {pct(f, 0.5):7.1f} "
                f"{pct(f, 0.99):8.1f} {max(f):9.1f} | {note}"
            )
        cost = statistics.fmean(process["fill"]) - statistics.fmean(direct["fill"])
        r["process_cost_per_mask_us"] = cost * 1e6
        print(f"{name:<11} worker process: +{cost * 1e6:.0f} us per single-row mask (round trip) over direct")
        if args.rows:
            si, sp = [v * 1e3 for v in inline["step"]], [v * 1e3 for v in process["step"]]
            r["step_ms"] = {
                "rows": args.rows,
                "inline": summary(si),
                "process": summary(sp),
                "ratio_p50": pct(sp, 0.5) / pct(si, 0.5),
            }
            print(
                f"{name:<11} one step of {args.rows} rows (fill + advance): inline p50 {pct(si, 0.5):.2f} ms, "
                f"process p50 {pct(sp, 0.5):.2f} ms (x{pct(sp, 0.5) / pct(si, 0.5):.2f}), p99 "
                f"{pct(si, 0.99):.2f} / {pct(sp, 0.99):.2f} ms over {len(sp)} steps"
            )
    print("saved", save("masks", res))


if __name__ == "__main__":
    main()
