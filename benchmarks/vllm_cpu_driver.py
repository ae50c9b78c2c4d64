"""vLLM's side of `vs_vllm_cpu.py`: runs under the peer venv's Python (vLLM is not a dependency
of this project), keeps one `vllm.LLM` alive and answers commands, one JSON line each.

stdin, one JSON object a line:
    {"cmd": "load", "prompts": [[token ids], ...], "schema": {...} | null, "max_tokens": 96,
     "temperature": 0.0, "seeds": [per prompt] | null, "ignore_eos": false}   (the last three optional)
    {"cmd": "run", "reset_cache": false}   -> {"wall_s", "output_tokens", "texts", ...}
    {"cmd": "profile"}                     -> one round under vLLM's torch profiler (--profile-dir)
    {"cmd": "quit"}
Answers go to the stdout this process started with; everything vLLM logs goes to stderr.

The prompts arrive as token ids (rendered by our engine's chat template), so both systems see
exactly the same input. Greedy (temperature 0) unless "temperature" says otherwise (then one
seed per prompt from "seeds"), stop at EOS, the same max_tokens for all.

    python vllm_cpu_driver.py --model DIR [--threads 2] [--kv-space-gib 2] [--max-num-seqs N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF model folder")
    ap.add_argument("--threads", type=int, default=2, help="OpenMP threads of vLLM's CPU worker")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND (default: cores 0..threads-1)")
    ap.add_argument("--kv-space-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default: vLLM's (256 on CPU)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: vLLM's (4096 on CPU)")
    ap.add_argument("--enforce-eager", action="store_true", help="no torch.compile (default: vLLM's inductor)")
    ap.add_argument("--profile-dir", default=None, help="enable vLLM's torch profiler, traces and tables here")
    args = ap.parse_args()

    # vLLM's CPU settings (docs: getting_started/installation/cpu, "Related runtime environment
    # variables"); a value already in the environment wins.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", args.bind or f"0-{args.threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_space_gib))
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    # Keep the answer channel clean: vLLM (and the worker processes it spawns) log to fd 1.
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    kw = {}
    if args.max_num_seqs is not None:
        kw["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens is not None:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.profile_dir:
        kw["profiler_config"] = {
            "profiler": "torch",
            "torch_profiler_dir": args.profile_dir,
            "torch_profiler_with_stack": False,
        }
    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        enable_prefix_caching=True,
        seed=0,
        enforce_eager=args.enforce_eager,
        **kw,
    )
    cfg = llm.llm_engine.vllm_config
    info = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "startup_s": time.perf_counter() - t0,
        "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU") or k == "OMP_NUM_THREADS"},
        "max_num_seqs": cfg.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
        "block_size": cfg.cache_config.block_size,
        "enable_prefix_caching": cfg.cache_config.enable_prefix_caching,
        "compilation_mode": str(cfg.compilation_config.mode),
        "compilation_backend": cfg.compilation_config.backend,
        "structured_outputs_backend": cfg.structured_outputs_config.backend,
    }
    answers.write(json.dumps({"ready": info}) + "\n")

    prompts, params = None, None
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        if cmd["cmd"] == "load":
            prompts = [TokensPrompt(prompt_token_ids=ids) for ids in cmd["prompts"]]
            so = StructuredOutputsParams(json=cmd["schema"]) if cmd.get("schema") else None
            temperature, seeds = cmd.get("temperature", 0.0), cmd.get("seeds")
            params = [
                SamplingParams(
                    temperature=temperature,
                    max_tokens=cmd["max_tokens"],
                    structured_outputs=so,
                    seed=None if seeds is None else seeds[i],
                    ignore_eos=bool(cmd.get("ignore_eos")),
                )
                for i in range(len(prompts))
            ]
            answers.write(json.dumps({"loaded": len(prompts)}) + "\n")
            continue
        if cmd.get("reset_cache"):
            llm.reset_prefix_cache()
        profiling = cmd["cmd"] == "profile"
        if profiling:
            llm.start_profile()
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t
        if profiling:
            llm.stop_profile()
        answers.write(
            json.dumps(
                {
                    "wall_s": wall,
                    "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                    "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
                    "cached_prompt_tokens": sum(o.num_cached_tokens or 0 for o in outs),
                    "finish_reasons": [o.outputs[0].finish_reason for o in outs],
                    "lengths": [len(o.outputs[0].token_ids) for o in outs],
                    "texts": [o.outputs[0].text for o in outs],
                }
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
