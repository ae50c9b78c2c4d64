"""Regex-constrained generation: normalize messy dates to ISO 8601 and phone numbers to E.164.

python examples/regex_patterns.py [--max-tokens N]
"""

from __future__ import annotations

import argparse
import re

from constrained_serve import Engine, SamplingParams

ISO_DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
E164 = r"\+[1-9][0-9]{7,14}"

DATES = ["the 5th of March 2024", "Dec 31, 2023", "2024/07/04"]
PHONES = ["(555) 010-4477, US", "+44 20 7946 0958", "030 1234567 in Berlin, Germany"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()
    params = SamplingParams(max_tokens=args.max_tokens)

    engine = Engine()
    prompts = [[{"role": "user", "content": f"Write this date as YYYY-MM-DD: {d}"}] for d in DATES]
    for d, r in zip(DATES, engine.chat(prompts, params, regex=ISO_DATE)):
        ok = r.finish_reason == "stop" and re.fullmatch(ISO_DATE, r.text) is not None
        print(f"{d!r:35} -> {r.text!r}  (matches: {ok})")

    prompts = [[{"role": "user", "content": f"Write this phone number in E.164 format: {p}"}] for p in PHONES]
    for p, r in zip(PHONES, engine.chat(prompts, params, regex=E164)):
        ok = r.finish_reason == "stop" and re.fullmatch(E164, r.text) is not None
        print(f"{p!r:35} -> {r.text!r}  (matches: {ok})")


if __name__ == "__main__":
    main()
