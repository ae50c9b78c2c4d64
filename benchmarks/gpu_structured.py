"""Structured extraction on the GPU (#20): constrained against unconstrained at the same output
lengths, and against HF ``generate`` + xgrammar's logits processor, on the same weights.

SmolLM2-1.7B's shape (benchmarks/configs/smollm2-1.7b.json) with the real SmolLM2 tokenizer
(the default model's folder, or ``--tokenizer``: the device machine gets a copy of it),
random weights (every matrix ~ N(0, --std)), bf16. The workload is benchmarks/structured.py's:
chat requests with a shared instruction and a varied text, its JSON Schema, greedy.

Per round: (a) llguidance, (a2) xgrammar, (b') unconstrained with each request writing as many
tokens as it did in (a) (ignore_eos): the same prefill and output tokens, so (a)/(b') is what
the structure costs per token. HF + xgrammar runs once, on all requests in one batch.
Targets: (a)/(b') >= 0.9; (a) >= 3x HF + xgrammar per output token; 100% valid with llguidance.

    python benchmarks/gpu_structured.py [--num-requests 256] [--repeats 2] [--skip-hf]
    python benchmarks/gpu_structured.py --config tiny-llama --num-requests 8 --device cpu --dtype float32  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.append(str(ROOT / "src"))

from gpu_correctness import build_checkpoint, default_tokenizer_dir  # noqa: E402
from gpu_e2e import config_path  # noqa: E402


def timed(device: str, fn):
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def run(args: argparse.Namespace) -> dict:
    import torch
    from structured import SCHEMA, count_tokens, hf_batches, valid, workload

    from constrained_serve import Engine, SamplingParams

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    report: dict = {
        "config": args.config,
        "dtype": args.dtype,
        "device": device,
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
        "num_requests": args.num_requests,
        "max_tokens": args.max_tokens,
        "cuda_graphs": not args.no_cuda_graphs,
        "pipeline": not args.no_pipeline,
    }
    convs = workload(args.num_requests, seed=args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        tok_dir = Path(args.tokenizer or default_tokenizer_dir())
        hf, tok = build_checkpoint(config_path(args.config), tok_dir, folder, args.std, dtype)
        engine = Engine(
            model=str(folder),
            dtype=args.dtype,
            device=device,
            max_num_seqs=args.num_requests,
            kv_cache_tokens=args.num_requests * (400 + args.max_tokens),
            cuda_graphs=not args.no_cuda_graphs,
            pipeline=not args.no_pipeline,
        )
        greedy = SamplingParams(max_tokens=args.max_tokens)
        engine.chat(convs[:4], greedy, schema=SCHEMA)  # warm-up: grammar workers, compile, kernels
        # xgrammar too: its tokenizer tables and compile would otherwise land in its timed round
        engine.chat(convs[:4], greedy, schema=SCHEMA, grammar_backend="xgrammar")
        engine.chat(convs[:4], greedy)

        def ours(params, **kw):
            if engine.kv.radix is not None:
                engine.kv.radix.evict(engine.pool.num_pages)  # each run computes its prompts
            rs, dt = timed(device, lambda: engine.chat(convs, params, **kw))
            toks = sum(r.usage.completion_tokens for r in rs)
            return rs, {"seconds": round(dt, 3), "output_tokens": toks, "tok_per_s": round(toks / dt, 1)}

        rounds = []
        for _ in range(args.repeats):
            row = {}
            rs, row["llguidance"] = ours(greedy, schema=SCHEMA)
            row["llguidance"]["valid"] = sum(valid(r.text) for r in rs) / len(rs)
            lengths = [max(1, r.usage.completion_tokens) for r in rs]
            same = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
            _, row["unconstrained_same_lengths"] = ours(same)
            rx, row["xgrammar"] = ours(greedy, schema=SCHEMA, grammar_backend="xgrammar")
            row["xgrammar"]["valid"] = sum(valid(r.text) for r in rx) / len(rx)
            row["ratio_llguidance_vs_unconstrained"] = round(
                row["llguidance"]["tok_per_s"] / row["unconstrained_same_lengths"]["tok_per_s"], 3
            )
            row["ratio_xgrammar_vs_unconstrained"] = round(
                row["xgrammar"]["tok_per_s"] / row["unconstrained_same_lengths"]["tok_per_s"], 3
            )
            print("ROUND " + json.dumps(row), flush=True)
            rounds.append(row)
        report["rounds"] = rounds
        for key in ("ratio_llguidance_vs_unconstrained", "ratio_xgrammar_vs_unconstrained"):
            report[key + "_median"] = statistics.median(r[key] for r in rounds)
        report["llguidance_valid_min"] = min(r["llguidance"]["valid"] for r in rounds)
        if engine.core.runner.graphs is not None:
            report["graph_replays"] = engine.core.runner.graphs.replays
        if engine.core.grammar is not None:
            g = engine.core.grammar
            report["bitmask_pinned"] = g.masks.shared.pinned  # cudaHostRegister took (grammar/shared_memory.py)
            report["prefilled_rows"] = g.stats["prefilled_rows"]  # masks filled ahead (prefill_masks)
            g.close()

        if not args.skip_hf:
            import xgrammar as xgr

            hf = hf.to(device).eval()
            info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=hf.config.vocab_size)
            compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
            [texts] = hf_batches(tok, convs, len(convs))

            def hf_run():
                enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
                with torch.inference_mode():
                    out = hf.generate(
                        **enc,
                        max_new_tokens=args.max_tokens,
                        do_sample=False,
                        logits_processor=[xgr.contrib.hf.LogitsProcessor(compiled)],
                        pad_token_id=tok.pad_token_id,
                    )
                return out[:, enc["input_ids"].shape[1] :]

            gen, dt = timed(device, hf_run)
            n = count_tokens(gen.cpu(), tok.eos_token_id)
            texts_out = tok.batch_decode(gen, skip_special_tokens=True)
            report["hf_xgrammar"] = {
                "seconds": round(dt, 3),
                "output_tokens": n,
                "tok_per_s": round(n / dt, 1),
                "valid": sum(valid(t) for t in texts_out) / len(texts_out),
            }
            best = statistics.median(r["llguidance"]["tok_per_s"] for r in rounds)
            report["llguidance_vs_hf_xgrammar"] = round(best / report["hf_xgrammar"]["tok_per_s"], 3)
            print("HF " + json.dumps(report["hf_xgrammar"]), flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    import torch

    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="smollm2-1.7b" if cuda else "tiny-llama")
    ap.add_argument("--tokenizer", default=os.environ.get("CS_TOKENIZER_DIR"), help="default: the default model's")
    ap.add_argument("--dtype", default="bfloat16" if cuda else "float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default=None)
    ap.add_argument("--std", type=float, default=0.02, help="std of every weight matrix")
    ap.add_argument("--num-requests", type=int, default=256 if cuda else 8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--no-pipeline", action="store_true", help="Engine(pipeline=False)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    report = run(args)
    text = json.dumps(report, indent=1)
    print(text)
    paths = [args.json]
    if os.environ.get("OUT"):
        tag = args.config + ("-unpipelined" if args.no_pipeline else "")
        paths.append(str(Path(os.environ["OUT"]) / f"gpu_structured-{tag}.json"))
    for path in filter(None, paths):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
