"""A multi-turn conversation. Each turn appends only its new tokens: the engine keeps the
exact token ids of the history, so the prefix cache serves everything said before
(watch `cached` grow) and only the new message is computed.

    python examples/conversation.py [--max-tokens N]
"""

from __future__ import annotations

import argparse

from constrained_serve import Engine, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    params = SamplingParams(max_tokens=args.max_tokens)

    engine = Engine()
    system = "You are a friendly assistant in a bicycle shop. Answer in one or two sentences."
    with engine.conversation(system=system) as conv:  # close() releases the pinned history
        for message in [
            "Hi! I ride 8 km to work on city streets. What kind of bike should I look at?",
            "What about rainy days?",
            "Thanks. Which of those would you recommend for a tight budget?",
        ]:
            r = conv.send(message, params)
            u = r.usage
            print(f"user: {message}\nassistant: {r.text.strip()}")
            print(
                f"  [prompt {u.prompt_tokens} tokens, {u.cached_tokens} from cache, {u.completion_tokens} generated]\n"
            )
        print(f"{len(conv.history)} messages in the history")


if __name__ == "__main__":
    main()
