"""Our engine's side of `busy_machine.py`: one `Engine` in a process of its own, driven by the
same JSON-lines protocol as `vllm_cpu_driver.py`, so the benchmark can run two engines side by
side (two processes, as two notebooks or a test run beside a job would be) and treat ours and
vLLM alike.

stdin, one JSON object a line:
    {"cmd": "encode_chat", "conversations": [[messages], ...]}   -> {"prompts": [[token ids], ...]}
    {"cmd": "load", "prompts": [[token ids], ...], "schema": {...} | null, "max_tokens": 48, "ignore_eos": false}
    {"cmd": "run"}   -> {"wall_s", "output_tokens", "lengths", "texts", "threads"}
    {"cmd": "quit"}
Answers go to the stdout this process started with; log lines go to stderr.

    python engine_driver.py [--threads 2] [--dtype float32] [--max-num-seqs 64]

The engine runs with the defaults users get (the thread tuner on), except the options named.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None, help="most torch threads (default: the engine's)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--fixed-threads", action="store_true", help="no thread tuner (adaptive_threads=False)")
    args = ap.parse_args()

    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    logging.basicConfig(level=logging.INFO, format="ours[%(process)d] %(name)s: %(message)s")

    import torch

    from constrained_serve import Engine, SamplingParams

    t0 = time.perf_counter()
    engine = Engine(
        num_threads=args.threads,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        adaptive_threads=not args.fixed_threads,
    )
    info = {"startup_s": time.perf_counter() - t0, "torch": torch.__version__, "threads": torch.get_num_threads()}
    answers.write(json.dumps({"ready": info}) + "\n")

    prompts, params, spec = None, None, {}
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        if cmd["cmd"] == "encode_chat":  # the prompts both systems get: our chat template's rendering
            answers.write(json.dumps({"prompts": [engine.encode_chat(c) for c in cmd["conversations"]]}) + "\n")
            continue
        if cmd["cmd"] == "load":
            prompts = cmd["prompts"]
            params = SamplingParams(max_tokens=cmd["max_tokens"], ignore_eos=bool(cmd.get("ignore_eos")))
            spec = {"schema": cmd["schema"]} if cmd.get("schema") else {}
            answers.write(json.dumps({"loaded": len(prompts)}) + "\n")
            continue
        t = time.perf_counter()
        rs = engine.generate(prompts, params, **spec)
        wall = time.perf_counter() - t
        tuner = engine.core.runner.thread_tuner
        answers.write(
            json.dumps(
                {
                    "wall_s": wall,
                    "output_tokens": sum(r.usage.completion_tokens for r in rs),
                    "lengths": [r.usage.completion_tokens for r in rs],
                    "texts": [r.text for r in rs],
                    "threads": torch.get_num_threads(),
                    "tuner_switches": None if tuner is None else tuner.switches,
                }
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
