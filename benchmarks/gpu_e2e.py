"""End to end: constrained-serve Engine vs HF transformers ``generate`` on the same random
weights, Llama-3.2-1B / Llama-3.1-8B shapes, N requests with a fixed output length.

    python benchmarks/gpu_e2e.py --config llama-3.2-1b [--num-requests 256] [--output-len 128]

The model folder is built offline in a temp dir: config.json from benchmarks/configs/<name>.json
plus a synthetic word-level tokenizer of the config's vocab size (prompts are random token
ids, so the tokenizer only has to exist). The Engine loads it with load_format="dummy"; its
random weights are then copied (unfused) into the HF model, so both run the same network and
greedy outputs can be compared (bf16 kernels differ, so a match rate is reported, not asserted).
Writes JSON to $OUT/gpu_e2e-<config>.json when $OUT is set, and to --json when given.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "benchmarks" / "configs"


def config_path(name: str) -> Path:
    p = Path(name)
    if p.suffix == ".json" and p.exists():
        return p
    p = CONFIGS / f"{name}.json"
    if not p.exists():
        known = sorted(c.stem for c in CONFIGS.glob("*.json"))
        raise SystemExit(f"unknown config {name!r}; known: {known}")
    return p


def build_model_dir(config_file: Path, dest: Path) -> dict:
    """config.json + a word-level tokenizer with one token per id, all offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    cfg = json.loads(config_file.read_text())
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(cfg, indent=1))
    V = int(cfg["vocab_size"])
    vocab = {f"<t{i}>": i for i in range(V)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<t0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    eos = cfg.get("eos_token_id", V - 1)
    eos = eos[0] if isinstance(eos, list) else eos
    bos = cfg.get("bos_token_id", 0)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<t0>", eos_token=f"<t{eos}>", bos_token=f"<t{bos}>", pad_token="<t0>"
    )
    fast.save_pretrained(str(dest))
    return cfg


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Stay clear of the special ids at the top of the Llama-3 vocab.
    hi = min(vocab, 128000) - 1
    return [[rng.randint(10, hi) for _ in range(length)] for _ in range(n)]


def copy_engine_weights_to_hf(engine_model, hf_model, cfg: dict) -> int:
    """Unfuse qkv_proj / gate_up_proj of the engine's model into HF's names. Returns how many
    HF tensors were set; raises if any HF parameter is left unset."""
    import torch

    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    q = cfg["num_attention_heads"] * hd
    kv = cfg["num_key_value_heads"] * hd
    hf_params = dict(hf_model.named_parameters())
    done: set[str] = set()

    def put(name: str, w: torch.Tensor) -> None:
        if name not in hf_params:
            raise KeyError(f"no HF parameter {name}")
        with torch.no_grad():
            hf_params[name].copy_(w)
        done.add(name)

    for name, w in engine_model.named_parameters():
        full = name if name.startswith("lm_head") else f"model.{name}"
        if ".qkv_proj." in full:
            for part, t in zip(("q_proj", "k_proj", "v_proj"), torch.split(w, [q, kv, kv], dim=0)):
                put(full.replace("qkv_proj", part), t)
        elif ".gate_up_proj." in full:
            for part, t in zip(("gate_proj", "up_proj"), torch.chunk(w, 2, dim=0)):
                put(full.replace("gate_up_proj", part), t)
        else:
            put(full, w)
    tied = cfg.get("tie_word_embeddings", False)
    missing = [n for n in hf_params if n not in done and not (tied and n == "lm_head.weight")]
    if missing:
        raise ValueError(f"HF parameters not set from the engine: {missing[:8]}")
    return len(done)


# HBM bandwidth by GPU name (TB/s), for the per-step bound; --hbm-tbps overrides.
HBM_TBPS = {"H200": 4.8, "H100": 3.35, "A100": 2.0}


def bandwidth_bound(engine, args: argparse.Namespace, ms_per_step: float) -> dict:
    """A decode step reads every weight once and each row's KV: at the GPU's HBM bandwidth,
    that is the fastest a step can be. Reported against the measured mean step (which also
    counts the prefill steps, so the share is a lower bound)."""
    import torch

    from constrained_serve.runtime.runner import ModelRunner

    name = torch.cuda.get_device_name(0)
    tbps = args.hbm_tbps or next((v for k, v in HBM_TBPS.items() if k in name), None)
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    per_token = ModelRunner.kv_bytes_per_token(engine.model, engine.dtype)
    mean_context = args.prompt_len + args.output_len / 2
    kv = min(args.num_requests, args.max_num_seqs) * mean_context * per_token
    out = {"weight_gb": round(weights / 1e9, 3), "kv_gb_mean_step": round(kv / 1e9, 3), "hbm_tbps": tbps}
    if tbps:
        bound_ms = (weights + kv) / (tbps * 1e12) * 1e3
        out["bound_ms"] = round(bound_ms, 3)
        out["share_of_bound"] = round(bound_ms / ms_per_step, 3)
    return out


def run(args: argparse.Namespace) -> dict:
    import torch

    if args.kernels:
        os.environ["CONSTRAINED_SERVE_KERNELS"] = args.kernels
    # Appended, so a PYTHONPATH that already provides constrained_serve wins.
    sys.path.append(str(ROOT / "src"))
    from constrained_serve import Engine, SamplingParams

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg_file = config_path(args.config)
    report: dict = {
        "config": args.config,
        "num_requests": args.num_requests,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "device": device,
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
        "kernels": os.environ.get("CONSTRAINED_SERVE_KERNELS", "auto"),
        "torch": torch.__version__,
    }
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / args.config
        cfg = build_model_dir(cfg_file, model_dir)
        prompts = make_prompts(args.num_requests, args.prompt_len, cfg["vocab_size"], args.seed)
        kv_tokens = args.num_requests * (args.prompt_len + args.output_len + 32)
        t0 = time.perf_counter()
        engine = Engine(
            model=str(model_dir),
            load_format="dummy",
            dtype=args.dtype,
            device=device,
            max_num_seqs=args.max_num_seqs,
            kv_cache_tokens=kv_tokens,
            cuda_graphs=not args.no_cuda_graphs,
            pipeline=not args.no_pipeline,
        )
        report["cuda_graphs"] = engine.core.runner.graphs is not None
        report["pipeline"] = engine.core.pipeline
        report["engine_load_s"] = round(time.perf_counter() - t0, 2)
        params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)

        def sync() -> None:
            if device == "cuda":
                torch.cuda.synchronize()

        engine.generate(prompts[: min(8, len(prompts))], SamplingParams(max_tokens=4, ignore_eos=True))
        sync()
        steps0 = engine.core.num_steps
        t0 = time.perf_counter()
        results = engine.generate(prompts, params)
        sync()
        dt = time.perf_counter() - t0
        lens = [len(r.token_ids) for r in results]
        steps = engine.core.num_steps - steps0
        report["engine"] = {
            "seconds": round(dt, 3),
            "output_tokens": sum(lens),
            "output_tok_per_s": round(sum(lens) / dt, 1),
            "all_full_length": all(n == args.output_len for n in lens),
            "steps": steps,
            "ms_per_step": round(1e3 * dt / max(steps, 1), 3),
        }
        if device == "cuda":
            report["engine"]["bandwidth_bound"] = bandwidth_bound(engine, args, report["engine"]["ms_per_step"])
        print("ENGINE " + json.dumps(report["engine"]), flush=True)

        if not args.skip_hf:
            from transformers import AutoConfig, AutoModelForCausalLM

            hf_cfg = AutoConfig.from_pretrained(str(model_dir))
            dtype = getattr(torch, args.dtype)
            with torch.device("meta"):
                hf = AutoModelForCausalLM.from_config(hf_cfg, torch_dtype=dtype)
            hf = hf.to_empty(device=device)
            # to_empty leaves the rotary inv_freq buffers uninitialized: recompute them.
            for m in hf.modules():
                if hasattr(m, "rope_init_fn") and hasattr(m, "inv_freq"):
                    inv, _ = m.rope_init_fn(m.config, device)
                    m.inv_freq.copy_(inv)
                    if hasattr(m, "original_inv_freq"):
                        m.original_inv_freq = inv
            try:
                report["hf_weights_copied"] = copy_engine_weights_to_hf(engine.model, hf, cfg)
                same_weights = True
            except Exception as e:  # throughput is still comparable on different weights
                report["hf_weights_error"] = f"{type(e).__name__}: {e}"[:500]
                same_weights = False
            if cfg.get("tie_word_embeddings"):
                hf.tie_weights()
            hf.eval()
            hf_tokens: list[list[int]] = []
            bs = args.hf_batch_size or len(prompts)
            sync()
            t0 = time.perf_counter()
            with torch.inference_mode():
                for i in range(0, len(prompts), bs):
                    ids = torch.tensor(prompts[i : i + bs], device=device)
                    out = hf.generate(
                        ids,
                        attention_mask=torch.ones_like(ids),
                        do_sample=False,
                        max_new_tokens=args.output_len,
                        min_new_tokens=args.output_len,
                        eos_token_id=None,
                        pad_token_id=0,
                    )
                    hf_tokens.extend(out[:, ids.shape[1] :].tolist())
            sync()
            dt = time.perf_counter() - t0
            n = sum(len(t) for t in hf_tokens)
            report["hf"] = {
                "seconds": round(dt, 3),
                "output_tokens": n,
                "output_tok_per_s": round(n / dt, 1),
                "batch_size": bs,
            }
            report["speedup_vs_hf"] = round(
                report["engine"]["output_tok_per_s"] / max(report["hf"]["output_tok_per_s"], 1e-9), 3
            )
            if same_weights:
                first = sum(r.token_ids[:1] == h[:1] for r, h in zip(results, hf_tokens))
                exact = sum(r.token_ids == h for r, h in zip(results, hf_tokens))
                report["greedy_match"] = {"first_token": first / len(results), "full_sequence": exact / len(results)}
            print("HF " + json.dumps(report["hf"]), flush=True)
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Engine vs HF generate, random weights, fixed output length")
    ap.add_argument(
        "--config",
        default="llama-3.2-1b",
        help="name under benchmarks/configs/ (llama-3.2-1b, llama-3.1-8b, tiny-llama) or a .json",
    )
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument(
        "--kernels",
        choices=["auto", "torch", "triton"],
        default=None,
        help="sets CONSTRAINED_SERVE_KERNELS for the engine",
    )
    ap.add_argument("--hf-batch-size", type=int, default=None, help="default: all requests at once")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="decode eagerly (Engine(cuda_graphs=False))")
    ap.add_argument("--no-pipeline", action="store_true", help="Engine(pipeline=False)")
    ap.add_argument("--hbm-tbps", type=float, default=None, help="HBM bandwidth for the step bound (default: by name)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the report here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        tag = f"{args.config}-{report['kernels']}" + ("-eager" if args.no_cuda_graphs else "")
        tag += "-unpipelined" if args.no_pipeline else ""
        (Path(os.environ["OUT"]) / f"gpu_e2e-{tag}.json").write_text(text)
    return 0 if report["engine"]["all_full_length"] else 1


if __name__ == "__main__":
    sys.exit(main())
