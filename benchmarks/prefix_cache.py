"""Prefix cache benefits on the default model, cache on vs off, in one run.

1. Time to first token of turn 3 of a conversation whose history is about 1,000 tokens,
   with the radix cache (turn 3 prefills only its new tokens) against the same request with
   the cache off (the whole history is prefilled). Target: at most 0.2x.
2. 64 extraction requests sharing a ~400-token instruction: prefill tokens computed and
   wall time, cache on vs off.

    python benchmarks/prefix_cache.py [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import engine_parser, machine, median, save  # noqa: E402

from constrained_serve import Engine, SamplingParams  # noqa: E402
from constrained_serve.engine.request import Request  # noqa: E402

FILLER = (
    "Our support policy covers shipping delays, damaged goods, billing errors and account access. "
    "Agents must be polite, concise and precise, quote order numbers, and never promise refunds "
    "that the policy does not allow. "
)


def ttft(engine: Engine, prompt_ids: list[int]) -> float:
    """Seconds from submit to the first sampled token of one request (nothing else running)."""
    r = Request(prompt_ids, SamplingParams(max_tokens=1), seed=0)
    t = time.perf_counter()
    engine.core.add(r)
    while not r.finished:
        engine.core.step()
    engine.core.drain_finished()
    return time.perf_counter() - t


def conversation_turn3(engine: Engine, repeats: int) -> dict:
    p = SamplingParams(max_tokens=48, ignore_eos=True)
    conv = engine.conversation(system="You are a support agent. " + FILLER * 9)
    conv.send("A customer says: " + FILLER * 6 + " What should I answer first?", p)
    conv.send("And what if the parcel is damaged as well? " + FILLER * 4, p)
    turn3 = conv.next_turn_ids("Summarise the whole case in one line.")
    history = len(conv.token_ids)
    # Cache on: the history is cached (and pinned); only the new turn is prefilled.
    on = [ttft(engine, turn3) for _ in range(repeats)]
    conv.close()
    off_engine = engine._off
    off = [ttft(off_engine, turn3) for _ in range(repeats)]
    return {
        "history_tokens": history,
        "turn3_prompt_tokens": len(turn3),
        "ttft_on_s": median(on),
        "ttft_off_s": median(off),
        "ratio": median(on) / median(off),
        "on_runs": on,
        "off_runs": off,
    }


def shared_instruction(engine_on: Engine, engine_off: Engine, n: int) -> dict:
    instruction = (
        "Extract the customer's name, the order number, the product, the problem category and "
        "the requested action as JSON. " + FILLER * 9
    )
    texts = [
        f"Ticket {i}: my order {1000 + i} of a blue kettle arrived broken, please replace it. Jane {i}"
        for i in range(n)
    ]
    convs = [[{"role": "system", "content": instruction}, {"role": "user", "content": t}] for t in texts]
    out = {"instruction_tokens": len(engine_on.encode_chat(convs[0][:1] + [{"role": "user", "content": ""}]))}
    for name, eng in (("on", engine_on), ("off", engine_off)):
        if eng.kv.radix is not None:
            eng.kv.radix.evict(eng.pool.num_pages)  # start cold: the instruction is computed once
        before = eng.core.runner.tokens_computed
        t = time.perf_counter()
        rs = eng.chat(convs, SamplingParams(max_tokens=8, ignore_eos=True))
        out[f"wall_{name}_s"] = time.perf_counter() - t
        out[f"computed_{name}"] = eng.core.runner.tokens_computed - before - sum(len(r.token_ids) - 1 for r in rs)
        out[f"cached_tokens_{name}"] = sum(r.usage.cached_tokens for r in rs)
    out["prefill_ratio"] = out["computed_on"] / out["computed_off"]
    out["wall_ratio"] = out["wall_on_s"] / out["wall_off_s"]
    return out


def main() -> None:
    ap = engine_parser(__doc__, repeats=3, n=64)
    args = ap.parse_args()
    on = Engine(model=args.model, num_threads=args.threads)
    off = Engine(model=args.model, num_threads=args.threads, enable_prefix_cache=False)
    on._off = off
    conv = conversation_turn3(on, args.repeats)
    print(
        f"turn 3 TTFT with a {conv['history_tokens']}-token history: cache on {conv['ttft_on_s'] * 1000:.0f} ms, "
        f"off {conv['ttft_off_s'] * 1000:.0f} ms, ratio {conv['ratio']:.3f} (target <= 0.2)"
    )
    shared = shared_instruction(on, off, args.n)
    print(
        f"{args.n} requests sharing a {shared['instruction_tokens']}-token instruction: prefill tokens computed "
        f"on {shared['computed_on']} vs off {shared['computed_off']} (ratio {shared['prefill_ratio']:.3f}); "
        f"wall on {shared['wall_on_s']:.1f} s vs off {shared['wall_off_s']:.1f} s (ratio {shared['wall_ratio']:.2f})"
    )
    print("machine:", machine())
    print("saved", save("prefix_cache", {"args": vars(args), "conversation": conv, "shared_instruction": shared}))


if __name__ == "__main__":
    main()
