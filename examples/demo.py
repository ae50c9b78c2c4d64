"""`make demo`: run the JSONL extraction CLI on examples/tickets.jsonl with the default model.

It extracts kind / summary / sentiment / rating / urgent / keywords from 36 short support
tickets, product reviews and invoices (schema: examples/extract.schema.json; instructions
with five worked examples: examples/demo_instructions.txt), writes
build/demo/tickets.out.jsonl, then prints a few rows. The CLI prints its own summary
(rows ok / failed / truncated, valid rate, throughput) to stderr. Each input row carries
its expected kind / sentiment / rating (never sent to the model); the demo ends with how
many rows the model labelled right: kind and sentiment equal, rating within one.

    python examples/demo.py [--max-tokens N] [--limit N]
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
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--limit", type=int, default=None, help="only the first N input lines")
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "build", "demo"))
    args = ap.parse_args()

    os.makedirs(args.out_dir, exist_ok=True)
    source = os.path.join(HERE, "tickets.jsonl")
    if args.limit is not None:
        with open(source) as f:
            head = [line for _, line in zip(range(args.limit), f)]
        fd, source = tempfile.mkstemp(suffix=".jsonl", dir=args.out_dir)
        with os.fdopen(fd, "w") as f:
            f.writelines(head)
    out = os.path.join(args.out_dir, "tickets.out.jsonl")
    if os.path.exists(out):
        os.remove(out)  # a demo starts fresh; a real job would resume instead

    print(
        f"constrained-serve extract {os.path.relpath(source)} --schema examples/extract.schema.json "
        f'--instructions "$(cat examples/demo_instructions.txt)" -o {os.path.relpath(out)}'
    )
    sys.stdout.flush()
    with open(os.path.join(HERE, "demo_instructions.txt")) as f:
        instructions = f.read()
    status = cli(
        [
            "extract",
            source,
            "--schema",
            os.path.join(HERE, "extract.schema.json"),
            "-o",
            out,
            "--instructions",
            instructions,
            "--max-tokens",
            str(args.max_tokens),
        ]
    )
    if status != 0:
        return status

    with open(out) as f:
        rows = [json.loads(line) for line in f]
    texts, expected = {}, {}
    with open(source) as f:
        for line in f:
            rec = json.loads(line)
            texts[rec["id"]] = rec["text"]
            expected[rec["id"]] = rec.get("expected")
    print(f"\n{len(rows)} rows in {os.path.relpath(out)}; the first few:\n")
    for row in rows[:4]:
        print(f"[{row['id']}] {texts.get(row['id'], '')[:90]}")
        print("   ->", json.dumps(row.get("output", row.get("error")), ensure_ascii=False))
    print()
    print(accuracy(rows, expected))
    if args.limit is not None:
        os.remove(source)
    return 0


def accuracy(rows: list[dict], expected: dict) -> str:
    """How many rows have the expected labels: kind and sentiment equal, rating within one."""
    n = right = 0
    fields = {"kind": 0, "sentiment": 0, "rating": 0}
    for row in rows:
        want, got = expected.get(row["id"]), row.get("output") or {}
        if not want:
            continue
        n += 1
        ok = {
            "kind": got.get("kind") == want["kind"],
            "sentiment": got.get("sentiment") == want["sentiment"],
            "rating": isinstance(got.get("rating"), int) and abs(got["rating"] - want["rating"]) <= 1,
        }
        for k, v in ok.items():
            fields[k] += v
        right += all(ok.values())
    if not n:
        return "accuracy: no labelled rows"
    per = ", ".join(f"{k} {v}/{n}" for k, v in fields.items())
    return f"accuracy: {right}/{n} rows labelled right ({100 * right / n:.0f}%; {per}; rating within one)"


if __name__ == "__main__":
    sys.exit(main())
