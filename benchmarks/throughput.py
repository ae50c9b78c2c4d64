"""Unconstrained throughput: our engine vs HF transformers `generate` (static batches of 16).

Same workload (64 chat requests of varied length, max_tokens 96, greedy, stop at EOS), same
model (the default SmolLM2-135M-Instruct unless --model), same torch thread count, one run.
Both systems run once per round (interleaved, so a drifting VM slows both alike). Prints
output tokens/s of each (medians over --repeats rounds) and the median per-round ratio.

    python benchmarks/throughput.py [--repeats 3] [--n 64] [--max-tokens 96] [--threads 2]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import chat_workload, engine_parser, machine, measure_rounds, per_round, save  # noqa: E402

from constrained_serve import Engine, SamplingParams  # noqa: E402


def run_hf(model_dir, tokenizer, convs, max_tokens, batch_size):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in convs]
    eos = tokenizer.eos_token_id

    def go():
        n_out = 0
        for i in range(0, len(texts), batch_size):
            enc = tokenizer(texts[i : i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.inference_mode():
                out = hf.generate(
                    **enc, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
                )
            gen = out[:, enc["input_ids"].shape[1] :]
            for row in gen.tolist():
                n_out += next((k + 1 for k, t in enumerate(row) if t == eos), len(row))
        return n_out, None

    return go


def main() -> None:
    ap = engine_parser(__doc__, repeats=3, n=64, max_tokens=96)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    convs = chat_workload(args.n)
    engine = Engine(model=args.model, num_threads=args.threads, max_num_seqs=max(64, args.n))
    params = SamplingParams(max_tokens=args.max_tokens)

    def ours():
        engine.kv.radix and engine.kv.radix.evict(engine.pool.num_pages)  # cold cache each repeat
        rs = engine.chat(convs, params)
        return sum(len(r.token_ids) for r in rs), None

    systems = {"ours": (ours, True)}
    if not args.skip_hf:
        systems["hf"] = (run_hf(engine.model_path, engine.tokenizer, convs, args.max_tokens, args.hf_batch), False)
    m = measure_rounds(systems, args.repeats)
    print(f"ours: {m['ours']['output_tokens']} output tokens; median {m['ours']['tokens_per_s']:.1f} tokens/s")
    result = {"workload": vars(args), "ours_tokens_per_s": m["ours"]["tokens_per_s"], "ours_runs": m["ours"]}
    if "hf" in m:
        ratio = per_round(m["ours"]["tokens_per_s_runs"], m["hf"]["tokens_per_s_runs"])
        print(f"hf generate (static batches of {args.hf_batch}): median {m['hf']['tokens_per_s']:.1f} tokens/s")
        print(f"ratio ours / hf: {ratio:.2f}x (median of per-round ratios)")
        result.update(hf_tokens_per_s=m["hf"]["tokens_per_s"], ratio=ratio, hf_runs=m["hf"])
    print("machine:", machine())
    print("saved", save("throughput", result))


if __name__ == "__main__":
    main()
