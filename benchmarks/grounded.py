"""Grounded fields: compile time and mask time against the source's length (issue #39).

The source is the words of examples/tickets.jsonl's rows drawn at random to --words words
(names, ids, amounts, emails, quotes and punctuation, no repeated passages); the schema is the demo's (six nullable
grounded strings). For each length, --repeats times with a fresh grammar each time (a
grounded grammar is per source):

- ``compile``: what the compile worker does for a row: the Lark grammar written from the
  schema, llguidance's matcher built (the substring automaton included) and the submit-time
  probe of the first masks (LLGuidanceBackend.compile);
- ``mask``: one next-token mask fill, timed at every token of an output that quotes a
  ten-word span in each field (median and worst over the output), the first mask inside a
  value separately (the lexer state built there).

    python benchmarks/grounded.py [--words 100,1000,5000] [--repeats 5] [--unit words|chars]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from common import machine, save  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def source_of(words: int, seed: int = 0) -> str:
    """``words`` words of the demo's rows, shuffled: their names, ids, amounts, emails, quotes
    and punctuation, without the repeats a text made of copies would have (a substring
    automaton of a repeated text is small, so copies would flatter the figures)."""
    import random

    pool = [w for line in open(ROOT / "examples" / "tickets.jsonl") for w in json.loads(line)["text"].split()]
    rng = random.Random(seed)
    return " ".join(rng.choice(pool) for _ in range(words))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--words", default="100,1000,5000")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--unit", default="words", choices=("words", "chars"))
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from constrained_serve.grammar.base import allocate_bitmask
    from constrained_serve.grammar.llguidance import LLGuidanceBackend
    from constrained_serve.grammar.spec import make_output_spec
    from constrained_serve.grammar.tokenizer_data import TokenizerData
    from constrained_serve.models.loader import default_model_dir
    from constrained_serve.params import Grounding

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    vocab = len(tokenizer)
    backend = LLGuidanceBackend(TokenizerData.from_hf(tokenizer, vocab))
    schema = json.loads((ROOT / "examples" / "extract.schema.json").read_text())
    for field in schema["properties"].values():
        for key in ("maxLength", "pattern", "x-null-if-no-match"):  # the span alone is what is measured
            field.pop(key, None)
    base = make_output_spec(schema=schema)
    bitmask = allocate_bitmask(1, vocab)
    rows = []
    print(json.dumps(machine()))
    print(f"{'words':>6} {'chars':>7} {'compile ms':>11} {'1st mask ms':>12} {'mask ms (median)':>17} {'worst':>7}")
    for n in [int(x) for x in args.words.split(",")]:
        source = source_of(n)
        words = source.split()
        middle = " ".join(words[len(words) // 2 : len(words) // 2 + 10])
        output = json.dumps({k: middle for k in schema["properties"]}, ensure_ascii=False, separators=(",", ":"))
        ids = tokenizer.encode(output, add_special_tokens=False)
        compiles, firsts, masks = [], [], []
        for r in range(args.repeats):
            # a fresh source each time (one more word): nothing is reused across repeats
            spec = dataclasses.replace(base, grounding=Grounding((source + f" r{r}",), args.unit))
            t0 = time.perf_counter()
            compiled = backend.compile(spec)
            compiles.append(time.perf_counter() - t0)
            m = backend.new_matcher(compiled)
            times = []
            for t in ids:
                t0 = time.perf_counter()
                m.fill_bitmask(bitmask, 0)
                times.append(time.perf_counter() - t0)
                assert m.accept_tokens([t]), "the output is a span: the grammar must take it"
            firsts.append(times[len(tokenizer.encode('{"person":"', add_special_tokens=False))])
            masks.extend(times)
        row = {
            "words": n,
            "chars": len(source),
            "compile_ms": 1e3 * statistics.median(compiles),
            "first_mask_ms": 1e3 * statistics.median(firsts),
            "mask_ms_median": 1e3 * statistics.median(masks),
            "mask_ms_worst": 1e3 * max(masks),
        }
        rows.append(row)
        print(
            f"{n:>6} {len(source):>7} {row['compile_ms']:>11.1f} {row['first_mask_ms']:>12.2f} "
            f"{row['mask_ms_median']:>17.3f} {row['mask_ms_worst']:>7.2f}"
        )
    path = save("grounded", {"machine": machine(), "unit": args.unit, "repeats": args.repeats, "rows": rows})
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
