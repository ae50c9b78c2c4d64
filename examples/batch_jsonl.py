"""A batch from Python: stream a JSONL file through `engine.generate_iter` with a progress
bar. Rows are read lazily and decoded together (continuous batching); results come back
in input order. For big, resumable jobs use the CLI instead:

    constrained-serve extract examples/tickets.jsonl --schema examples/extract.schema.json -o out.jsonl

    python examples/batch_jsonl.py [--max-tokens N] [--limit N]
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os

from constrained_serve import Engine, SamplingParams

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--limit", type=int, default=None)
    args = ap.parse_args()

    with open(os.path.join(HERE, "extract.schema.json")) as f:
        schema = json.load(f)
    system = "Extract structured data from the text as JSON: " + json.dumps(schema["properties"])

    engine = Engine()
    with open(os.path.join(HERE, "tickets.jsonl")) as f:
        records = (json.loads(line) for line in itertools.islice(f, args.limit))
        ids: list[str] = []

        def conversations():
            for rec in records:
                ids.append(rec["id"])
                yield [{"role": "system", "content": system}, {"role": "user", "content": rec["text"]}]

        found: collections.Counter[str] = collections.Counter()  # fields the model filled, by name
        valid = 0
        results = engine.generate_iter(
            conversations(), SamplingParams(max_tokens=args.max_tokens), chat=True, schema=schema, progress=True
        )
        for i, r in enumerate(results):
            if r.json is not None:
                valid += 1
                found.update(k for k, v in r.json.items() if v is not None)
            else:
                print(f"{ids[i]}: {r.error}")
    print(f"{valid}/{len(ids)} rows valid; fields filled: {dict(found)}")


if __name__ == "__main__":
    main()
