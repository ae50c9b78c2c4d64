"""Structured extraction: our engine (constrained / unconstrained) vs HF transformers
`generate` with xgrammar's logits processor vs Outlines, on one workload, in one process.

64 chat requests = a shared instruction (system message + field description, ~100 tokens)
+ a varied text of 40-120 words (reviews, tickets, invoices generated here); one JSON Schema
with strings, an enum, an integer range, an array and a boolean; max_tokens 96; greedy.
HF and Outlines run static batches of 16. Prints wall time, output tokens/s (forced tokens
included for ours), valid-output rate, and the ratios. Systems run interleaved, one run
of each per round; ratios are medians of the per-round ratios.

(b) writes until max_tokens (the model rambles past the JSON without a grammar), so its
tokens/s amortizes the same prompts over more than twice the output. (b') isolates what the
structure costs: unconstrained again, but each request writes exactly as many tokens as it
did in (a) (ignore_eos, max_tokens = its length in (a)), so (a) and (b') do the same prefill
and produce the same number of tokens; only the grammar work (masks, fast-forward) differs.

Every system runs in the same --dtype (float32 by default; bfloat16 is about 4x faster for
the GEMMs on CPUs with avx512_bf16 or AMX, for HF and Outlines too).

    python benchmarks/structured.py [--repeats 2] [--threads 2] [--dtype float32|bfloat16]
                                    [--skip-hf] [--skip-outlines]
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import jsonschema
import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import engine_parser, machine, measure_rounds, per_round, save  # noqa: E402

from constrained_serve import Engine, SamplingParams  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["review", "ticket", "invoice"]},
        "customer": {"type": "string", "maxLength": 40},
        "product": {"type": "string", "maxLength": 40},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "issues": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
        "urgent": {"type": "boolean"},
    },
    "required": ["kind", "customer", "product", "rating", "issues", "urgent"],
    "additionalProperties": False,
}
INSTRUCTION = (
    "You are an information extraction system. Read the text and return one JSON object with the fields: "
    "kind (review, ticket or invoice), customer (the person's name), product (what it is about), rating "
    "(1 to 5, how satisfied the customer is), issues (up to three short problems mentioned) and urgent "
    "(true if the customer needs help right away). Answer with JSON only."
)
NAMES = [
    "Anna Keller",
    "Bob Martin",
    "Chen Wei",
    "Dana Ivanova",
    "Emil Novak",
    "Fatima Zahra",
    "Gus Olsen",
    "Hana Sato",
    "Ivan Petrov",
    "Julia Costa",
    "Kofi Mensah",
    "Laura Rossi",
]
PRODUCTS = [
    "espresso machine",
    "running shoes",
    "laptop stand",
    "wireless earbuds",
    "office chair",
    "electric kettle",
    "smart watch",
    "backpack",
    "desk lamp",
    "blender",
    "e-reader",
    "router",
]
PROBLEMS = [
    "arrived late",
    "the box was damaged",
    "stopped working after a week",
    "is louder than advertised",
    "the battery drains fast",
    "a part was missing",
    "the colour is wrong",
    "the manual is unclear",
    "I was charged twice",
    "support never answered",
    "the app keeps crashing",
    "it overheats",
]
FILLER = [
    "I have been a loyal customer for years.",
    "My neighbour recommended your shop.",
    "The delivery driver was friendly.",
    "I compared several brands before buying.",
    "The price seemed fair at the time.",
    "I use it every morning before work.",
    "My kids love it too.",
    "I read the reviews carefully before ordering.",
]


def make_text(rng: random.Random) -> str:
    kind = rng.choice(["review", "ticket", "invoice"])
    name, product = rng.choice(NAMES), rng.choice(PRODUCTS)
    probs = rng.sample(PROBLEMS, rng.randint(0, 3))
    parts = []
    if kind == "review":
        parts.append(f"Review by {name}: I bought the {product} last month.")
    elif kind == "ticket":
        parts.append(f"Support ticket from {name}. Subject: problem with my {product}.")
    else:
        parts.append(
            f"Invoice dispute. Customer: {name}. Item: {product}, order {rng.randint(10000, 99999)}, "
            f"amount {rng.randint(20, 900)}.{rng.randint(0, 99):02d} EUR."
        )
    parts += [f"Unfortunately it {p}." for p in probs]
    while len(" ".join(parts).split()) < rng.randint(40, 120):
        parts.append(rng.choice(FILLER))
    if rng.random() < 0.3:
        parts.append("Please help me as soon as possible, this is urgent!")
    return " ".join(parts)


def workload(n: int, seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed)
    return [[{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": make_text(rng)}] for _ in range(n)]


def valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def run_ours(engine: Engine, convs, params, constrained: bool, lengths: list[int] | None = None):
    """lengths: filled with each request's completion tokens (for (b'))."""

    def go():
        if engine.kv.radix is not None:
            engine.kv.radix.evict(engine.pool.num_pages)  # cold cache: the shared prefix is computed once per run
        kw = {"schema": SCHEMA} if constrained else {}
        rs = engine.chat(convs, params, **kw)
        if lengths is not None:
            lengths[:] = [r.usage.completion_tokens for r in rs]
        return sum(r.usage.completion_tokens for r in rs), sum(valid(r.text) for r in rs) / len(rs)

    return go


def hf_batches(tok, convs, batch):
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in convs]
    return [texts[i : i + batch] for i in range(0, len(texts), batch)]


def count_tokens(gen_ids, eos: int) -> int:
    return sum(next((k + 1 for k, t in enumerate(row) if t == eos), len(row)) for row in gen_ids.tolist())


def run_hf_xgrammar(model_dir, tok, convs, max_tokens, batch, dtype):
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=hf.config.vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    batches = hf_batches(tok, convs, batch)

    def go():
        n_tok, n_valid, n = 0, 0, 0
        for texts in batches:
            enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            proc = xgr.contrib.hf.LogitsProcessor(compiled)
            with torch.inference_mode():
                out = hf.generate(
                    **enc,
                    max_new_tokens=max_tokens,
                    do_sample=False,
                    logits_processor=[proc],
                    pad_token_id=tok.pad_token_id,
                )
            gen = out[:, enc["input_ids"].shape[1] :]
            n_tok += count_tokens(gen, tok.eos_token_id)
            for row in tok.batch_decode(gen, skip_special_tokens=True):
                n_valid += valid(row)
                n += 1
        return n_tok, n_valid / n

    return go


def run_outlines(model_dir, tok, convs, max_tokens, batch, dtype):
    import outlines
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    model = outlines.from_transformers(hf, tok)
    gen = outlines.Generator(model, outlines.json_schema(SCHEMA))
    batches = hf_batches(tok, convs, batch)

    def go():
        n_tok, n_valid, n = 0, 0, 0
        for texts in batches:
            outs = gen.batch(texts, max_new_tokens=max_tokens, do_sample=False)
            for o in outs:
                n_tok += len(tok(o, add_special_tokens=False)["input_ids"])
                n_valid += valid(o)
                n += 1
        return n_tok, n_valid / n

    return go


def main() -> None:
    ap = engine_parser(__doc__, repeats=2, n=64, max_tokens=96, dtype=True)
    ap.add_argument("--batch", type=int, default=16, help="static batch size of HF and Outlines")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-outlines", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    convs = workload(args.n)
    dtype = getattr(torch, args.dtype)
    engine = Engine(model=args.model, num_threads=args.threads, max_num_seqs=max(64, args.n), dtype=dtype)
    res = {"args": vars(args)}
    greedy = SamplingParams(max_tokens=args.max_tokens)
    lengths: list[int] = []  # (a)'s completion lengths, filled by its warm-up run
    systems = {
        "(a) ours, constrained": (run_ours(engine, convs, greedy, True, lengths), True),
        "(b) ours, unconstrained": (run_ours(engine, convs, greedy, False), True),
        "(b') ours, unconstrained, (a)'s lengths": (
            lambda: run_ours(engine, convs, [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths], False)(),
            True,
        ),
    }
    if not args.skip_hf:
        systems["(c) HF generate + xgrammar"] = (
            run_hf_xgrammar(engine.model_path, engine.tokenizer, convs, args.max_tokens, args.batch, dtype),
            False,
        )
    if not args.skip_outlines:
        try:
            systems["(d) Outlines (transformers)"] = (
                run_outlines(engine.model_path, engine.tokenizer, convs, args.max_tokens, args.batch, dtype),
                False,
            )
        except ImportError as e:
            print(f"(d) Outlines not installed ({e}); `pip install outlines` to include it")
    measured = measure_rounds(systems, args.repeats)
    keys = {
        "(a) ours, constrained": "ours_constrained",
        "(b) ours, unconstrained": "ours_unconstrained",
        "(b') ours, unconstrained, (a)'s lengths": "ours_unconstrained_same_lengths",
        "(c) HF generate + xgrammar": "hf_xgrammar",
        "(d) Outlines (transformers)": "outlines",
    }
    for name, m in measured.items():
        res[keys[name]] = m
        print(
            f"{name:<40} wall {m['wall_s']:7.1f} s   output tokens/s {m['tokens_per_s']:7.1f}   "
            f"valid {m['valid_rate'] * 100:5.1f}%   (per round: {[round(t, 1) for t in m['runs']]})"
        )
    a, b, b2 = res["ours_constrained"], res["ours_unconstrained"], res["ours_unconstrained_same_lengths"]

    res["structure_cost_ratio"] = per_round(a["tokens_per_s_runs"], b["tokens_per_s_runs"])
    print(f"(a)/(b) output tokens/s: {res['structure_cost_ratio']:.2f}x (target >= 0.95; median of per-round ratios)")
    res["structure_cost_ratio_same_lengths"] = per_round(a["tokens_per_s_runs"], b2["tokens_per_s_runs"])
    print(f"(a)/(b') output tokens/s, same output lengths: {res['structure_cost_ratio_same_lengths']:.2f}x")
    baselines = [res[k]["runs"] for k in ("hf_xgrammar", "outlines") if k in res]
    if baselines:
        fastest = [min(ts) for ts in zip(*baselines)]
        res["speedup_vs_fastest_baseline"] = per_round(fastest, a["runs"])
        print(
            f"wall-time speed-up of (a) over the faster of (c)/(d): {res['speedup_vs_fastest_baseline']:.2f}x "
            f"(target >= 3; median of per-round ratios)"
        )
    print("machine:", machine())
    print("saved", save("structured" if args.dtype == "float32" else f"structured-{args.dtype}", res))


if __name__ == "__main__":
    main()
