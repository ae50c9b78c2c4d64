"""Unconstrained throughput: our engine vs HF transformers `generate` (static batches of 16).

Same workload (64 chat requests of varied length, max_tokens 96, greedy, stop at EOS), same
model (the default SmolLM2-135M-Instruct unless --model), same torch thread count, one run.
Prints output tokens/s of each (medians over --repeats) and the ratio.

    python benchmarks/throughput.py [--repeats 3] [--n 64] [--max-tokens 96] [--threads 2]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import chat_workload, machine, median, save, timed  # noqa: E402

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
            enc = tokenizer(texts[i:i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.inference_mode():
                out = hf.generate(**enc, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
            gen = out[:, enc["input_ids"].shape[1]:]
            for row in gen.tolist():
                n_out += next((k + 1 for k, t in enumerate(row) if t == eos), len(row))
        return n_out

    return go


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
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
        return sum(len(r.token_ids) for r in rs)

    ours()  # warm-up (allocations, first-call overheads)
    ours_runs = [timed(ours) for _ in range(args.repeats)]
    ours_tps = median([n / t for t, n in ours_runs])
    print(f"ours: {ours_runs[0][1]} output tokens; tokens/s per repeat: "
          f"{[round(n / t, 1) for t, n in ours_runs]}; median {ours_tps:.1f}")
    result = {"workload": vars(args), "ours_tokens_per_s": ours_tps,
              "ours_runs": [{"seconds": t, "tokens": n} for t, n in ours_runs]}
    if not args.skip_hf:
        hf_go = run_hf(engine.model_path, engine.tokenizer, convs, args.max_tokens, args.hf_batch)
        hf_runs = [timed(hf_go) for _ in range(args.repeats)]
        hf_tps = median([n / t for t, n in hf_runs])
        print(f"hf generate (static batches of {args.hf_batch}): tokens/s per repeat: "
              f"{[round(n / t, 1) for t, n in hf_runs]}; median {hf_tps:.1f}")
        print(f"ratio ours / hf: {ours_tps / hf_tps:.2f}x")
        result.update(hf_tokens_per_s=hf_tps, ratio=ours_tps / hf_tps,
                      hf_runs=[{"seconds": t, "tokens": n} for t, n in hf_runs])
    print("machine:", machine())
    print("saved", save("throughput", result))


if __name__ == "__main__":
    main()
