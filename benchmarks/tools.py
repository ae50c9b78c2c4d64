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

The peer, vLLM's CPU build with its hermes tool parser (model writes freely, text parsed
after), runs only where its venv exists (--vllm-python, default /work/peers/vllm/bin/python;
see vs_vllm_cpu.py for installing it); the vLLM side is not wired in yet: without the peer
(or until it is) only our numbers are reported, and the script says so.

    python benchmarks/tools.py [--repeats 3] [--n 32] [--threads 2]
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
from common import engine_parser, median, save, timed  # noqa: E402

from constrained_serve import Engine, SamplingParams  # noqa: E402
from tests.tools.tool_set import FEW_SHOT, SCHEMAS, TOOLS  # noqa: E402

DEFAULT_VLLM_PYTHON = "/work/peers/vllm/bin/python"

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


def check_text(text: str) -> tuple[int, int]:
    """(attempted calls, valid calls) in a raw output, read the way a text parser reads it
    (hermes: each <tool_call>...</tool_call> block is a JSON object {name, arguments}); a
    marker without its closing tag counts as an attempt that failed."""
    attempts = max(text.count("<tool_call>"), len(CALL.findall(text)))
    valid = 0
    for block in CALL.findall(text):
        try:
            obj = json.loads(block)
            jsonschema.validate(obj["arguments"], SCHEMAS[obj["name"]])
            valid += 1
        except Exception:  # noqa: BLE001 - any failure is an invalid call
            pass
    return attempts, valid


def run_ours(engine: Engine, convs: list[list[dict]], max_tokens: int) -> dict:
    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i) for i in range(len(convs))]
    wall, results = timed(lambda: engine.chat(convs, params, tools=TOOLS))
    attempts = valid = returned = 0
    for r in results:
        a, _ = check_text(r.text)
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


def main() -> None:
    ap = engine_parser(__doc__, repeats=3, n=32, max_tokens=100)
    ap.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(model=args.model, max_num_seqs=args.n)
    convs = workload(args.n)
    run_ours(engine, convs[:4], args.max_tokens)  # warm up: workers, the compile cache
    rounds = []
    for k in range(args.repeats):
        r = run_ours(engine, convs, args.max_tokens)
        rounds.append(r)
        share = r["valid"] / r["attempts"] if r["attempts"] else 1.0
        print(
            f"  round {k + 1}: ours  {r['wall_s']:6.1f} s  {r['returned'] / r['wall_s']:5.2f} calls/s  "
            f"{r['returned']} calls returned of {r['attempts']} attempted, valid {share * 100:5.1f}%",
            flush=True,
        )
    ours = {
        "calls_per_s": median([r["returned"] / r["wall_s"] for r in rounds]),
        "valid_share": median([r["valid"] / r["attempts"] if r["attempts"] else 1.0 for r in rounds]),
        "rounds": rounds,
    }
    print(f"ours: {ours['calls_per_s']:.2f} tool calls/s, {ours['valid_share'] * 100:.1f}% of attempted calls valid")
    if not os.path.exists(args.vllm_python):
        peer = f"peer missing: {args.vllm_python} does not exist (vllm-cpu in its own venv); only ours reported"
    else:
        peer = "the vLLM side (hermes tool parser) is not wired into this benchmark yet; only ours reported"
    print(peer)
    save("tools", {"workload": {"n": args.n, "max_tokens": args.max_tokens}, "ours": ours, "peer": peer})


if __name__ == "__main__":
    main()
