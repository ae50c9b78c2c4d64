"""Time to first token for one long prompt: our engine vs HF transformers `generate`.

One prompt of about --lengths tokens (default 512, 1024 and 2048), max_tokens 1, greedy, cold
prefix cache: the time is the prefill (chunked in our engine, one forward in HF's) plus one
sampled token. Same model, dtype and torch thread count for both. A third column runs our
engine with the long-chunk attention forced onto the batched torch.bmm GEMMs (what the CPU
used before the per-head oneDNN path, kernels/long_chunks.py), to show what that path is
worth. Systems run interleaved, once per round; times are medians over --repeats rounds,
ratios medians of the per-round ratios.

    python benchmarks/prefill.py [--repeats 5] [--lengths 512 1024 2048] [--threads 2]
                                 [--dtype float32|bfloat16] [--skip-hf]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import engine_parser, machine, measure_rounds, per_round, save  # noqa: E402

from constrained_serve import Engine, SamplingParams  # noqa: E402
from constrained_serve.kernels import long_chunks  # noqa: E402

WORDS = (
    "the invoice lists seven items shipped from the northern warehouse on a rainy monday and the "
    "customer says two of them arrived broken while support promised a refund within ten days"
).split()


def prompt_of(tokenizer, n_tokens: int) -> str:
    """Plain prose of about n_tokens tokens (numbered words, so nothing repeats exactly)."""
    words = [f"{WORDS[i % len(WORDS)]}{i // len(WORDS)}" for i in range(n_tokens)]
    ids = tokenizer(" ".join(words), add_special_tokens=False)["input_ids"][:n_tokens]
    return tokenizer.decode(ids)


def main() -> None:
    ap = engine_parser(__doc__, repeats=5, dtype=True)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    engine = Engine(model=args.model, num_threads=args.threads, dtype=args.dtype)
    tok = engine.tokenizer
    params = SamplingParams(max_tokens=1)
    per_head = long_chunks.per_head_onednn
    hf = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(engine.model_path), dtype=engine.dtype).eval()

    def ours(text: str, batched: bool):
        def go():
            long_chunks.per_head_onednn = (lambda dtype, device: False) if batched else per_head
            try:
                engine.kv.radix and engine.kv.radix.evict(engine.pool.num_pages)  # cold cache
                [r] = engine.generate([text], params)
                return r.usage.prompt_tokens, None
            finally:
                long_chunks.per_head_onednn = per_head

        return go

    def hf_go(text: str):
        enc = tok(text, return_tensors="pt", add_special_tokens=False)

        def go():
            with torch.inference_mode():
                hf.generate(**enc, max_new_tokens=1, do_sample=False, pad_token_id=tok.eos_token_id)
            return enc["input_ids"].shape[1], None

        return go

    results = []
    for n in args.lengths:
        text = prompt_of(tok, n)
        systems = {"ours": (ours(text, False), True), "ours_batched_attention": (ours(text, True), True)}
        if hf is not None:
            systems["hf_generate"] = (hf_go(text), True)
        m = measure_rounds(systems, args.repeats)  # prints prompt tokens/s per round
        row = {
            "prompt_tokens": m["ours"]["output_tokens"],
            **{f"{name}_s": r["wall_s"] for name, r in m.items()},
            "runs": {name: r["runs"] for name, r in m.items()},
        }
        row["batched_attention_slowdown"] = per_round(m["ours_batched_attention"]["runs"], m["ours"]["runs"])
        line = (
            f"{row['prompt_tokens']:5d} prompt tokens: ours {row['ours_s']:.3f} s, "
            f"ours with batched attention GEMMs {row['ours_batched_attention_s']:.3f} s "
            f"({row['batched_attention_slowdown']:.2f}x)"
        )
        if hf is not None:
            row["speedup_vs_hf"] = per_round(m["hf_generate"]["runs"], m["ours"]["runs"])
            line += f", HF generate {row['hf_generate_s']:.3f} s ({row['speedup_vs_hf']:.2f}x)"
        print(line)
        results.append(row)
    print("machine:", machine())
    print(
        "saved", save(f"prefill-{str(engine.dtype).removeprefix('torch.')}", {"args": vars(args), "results": results})
    )


if __name__ == "__main__":
    main()
