"""`make demo`: run the JSONL extraction CLI on the held-out test rows with the default model.

It copies who and what short support tickets, product reviews, invoices and emails name
(person, company, order or invoice number, amount, email, due date; schema:
examples/extract.schema.json, whose shaped fields carry a pattern and "x-null-if-no-match";
instructions with three worked examples: examples/demo_instructions.txt) twice: with
grounding on (``--grounded --spans``: every value must be a verbatim span of the row's text)
into build/demo/tickets.out.jsonl, and without into build/demo/tickets.ungrounded.out.jsonl.
The CLI prints its own summary (rows ok / failed / truncated, valid rate, throughput) to
stderr. Each input row carries the values a person wrote down before any run (never sent to
the model); the demo ends with how many fields each run got exactly right, per field, and
the share of grounded values that are verbatim spans of their text (100% by construction).

The rows: examples/tickets_test.jsonl (46, the measure: written and committed before any
model run on them, never tuned on) by default; ``--rows dev`` runs examples/tickets.jsonl
(50, the development rows the schema and instructions were tuned on) instead.

    python examples/demo.py [--rows test|dev] [--max-tokens N] [--limit N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from constrained_serve.cli import main as cli

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", choices=("test", "dev"), default="test", help="held-out test rows or the dev rows")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--limit", type=int, default=None, help="only the first N input lines")
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "build", "demo"))
    args = ap.parse_args()

    os.makedirs(args.out_dir, exist_ok=True)
    source = os.path.join(HERE, "tickets_test.jsonl" if args.rows == "test" else "tickets.jsonl")
    if args.limit is not None:
        with open(source) as f:
            head = [line for _, line in zip(range(args.limit), f)]
        fd, source = tempfile.mkstemp(suffix=".jsonl", dir=args.out_dir)
        with os.fdopen(fd, "w") as f:
            f.writelines(head)
    with open(os.path.join(HERE, "demo_instructions.txt")) as f:
        instructions = f.read()
    runs = {}
    for name, flags in (("grounded", ["--grounded", "--spans"]), ("ungrounded", [])):
        out = os.path.join(args.out_dir, "tickets.out.jsonl" if flags else "tickets.ungrounded.out.jsonl")
        if os.path.exists(out):
            os.remove(out)  # a demo starts fresh; a real job would resume instead
        print(
            f"constrained-serve extract {os.path.relpath(source)} --schema examples/extract.schema.json "
            f'--instructions "$(cat examples/demo_instructions.txt)" {" ".join(flags)} -o {os.path.relpath(out)}'
        )
        sys.stdout.flush()
        argv = ["extract", source, "--schema", os.path.join(HERE, "extract.schema.json"), "-o", out]
        status = cli([*argv, "--instructions", instructions, "--max-tokens", str(args.max_tokens), *flags])
        if status != 0:
            return status
        with open(out) as f:
            runs[name] = [json.loads(line) for line in f]

    texts, expected = {}, {}
    with open(source) as f:
        for line in f:
            rec = json.loads(line)
            texts[rec["id"]] = rec["text"]
            expected[rec["id"]] = rec.get("expected")
    rows = runs["grounded"]
    print(f"\n{len(rows)} rows in {os.path.relpath(args.out_dir)}/tickets.out.jsonl; the first few:\n")
    for row in rows[:4]:
        print(f"[{row['id']}] {texts.get(row['id'], '')[:90]}")
        print("   ->", json.dumps(row.get("output", row.get("error")), ensure_ascii=False))
        print("   spans:", json.dumps(row.get("spans"), ensure_ascii=False))
    print(f"\n{args.rows} rows ({os.path.relpath(source)})")
    print(accuracy(runs, expected, texts))
    if args.limit is not None:
        os.remove(source)
    return 0


def accuracy(runs: dict[str, list[dict]], expected: dict, texts: dict) -> str:
    """Per field, how many rows each run got exactly right (the labelled value, or null where
    the text has none); and the share of grounded values that are verbatim spans."""
    fields = list(next((e for e in expected.values() if e), {}))
    lines, totals = [], {}
    width = max(len(f) for f in fields) if fields else 5
    lines.append(f"{'field':<{width}}  " + "  ".join(f"{name:>12}" for name in runs))
    per: dict[str, dict[str, int]] = {name: {} for name in runs}
    n = 0
    for name, rows in runs.items():
        right = values_right = values = 0
        for row in rows:
            want, got = expected.get(row["id"]), row.get("output") or {}
            if not want:
                continue
            for f in fields:
                hit = got.get(f) == want[f] if "output" in row else False
                per[name][f] = per[name].get(f, 0) + hit
                right += hit
                if want[f] is not None:
                    values += 1
                    values_right += hit
        n = sum(1 for row in rows if expected.get(row["id"]))
        totals[name] = (right, values_right, values)
    for f in fields:
        lines.append(f"{f:<{width}}  " + "  ".join(f"{per[name].get(f, 0):>9}/{n:<2}" for name in runs))
    cells = n * len(fields)
    summary = [
        f"{name}: {right}/{cells} fields exactly right ({100 * right / max(cells, 1):.0f}%), "
        f"{values_right}/{values} of the labelled values"
        for name, (right, values_right, values) in totals.items()
    ]
    grounded = runs.get("grounded", [])
    quoted = [(row["id"], v) for row in grounded for v in (row.get("output") or {}).values() if isinstance(v, str)]
    verbatim = sum(v in texts.get(i, "") for i, v in quoted)
    share = f"{verbatim}/{len(quoted)} grounded values are verbatim spans of their text" if quoted else ""
    return "accuracy (exact match per field, null where the text has none):\n" + "\n".join(lines + summary + [share])


if __name__ == "__main__":
    sys.exit(main())
