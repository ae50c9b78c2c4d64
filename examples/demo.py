"""`make demo`: run the JSONL extraction CLI on examples/tickets.jsonl with the default model.

It extracts kind / summary / sentiment / rating / urgent / keywords from 36 short support
tickets, product reviews and invoices (schema: examples/extract.schema.json), writes
build/demo/tickets.out.jsonl, then prints a few rows. The CLI prints its own summary
(rows ok / failed / truncated, valid rate, throughput) to stderr.

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

    print(f"constrained-serve extract {os.path.relpath(source)} --schema examples/extract.schema.json -o {os.path.relpath(out)}")
    sys.stdout.flush()
    status = cli(["extract", source, "--schema", os.path.join(HERE, "extract.schema.json"), "-o", out,
                  "--max-tokens", str(args.max_tokens)])
    if status != 0:
        return status

    with open(out) as f:
        rows = [json.loads(line) for line in f]
    texts = {}
    with open(source) as f:
        for line in f:
            rec = json.loads(line)
            texts[rec["id"]] = rec["text"]
    print(f"\n{len(rows)} rows in {os.path.relpath(out)}; the first few:\n")
    for row in rows[:4]:
        print(f"[{row['id']}] {texts.get(row['id'], '')[:90]}")
        print("   ->", json.dumps(row.get("output", row.get("error")), ensure_ascii=False))
    if args.limit is not None:
        os.remove(source)
    return 0


if __name__ == "__main__":
    sys.exit(main())
