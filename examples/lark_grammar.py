"""Lark grammars: the model writes arithmetic (grammars/arith.lark) and SQL
(grammars/sql_select.lark); `lark` parses what it wrote, and we evaluate the arithmetic.

    python examples/lark_grammar.py [--max-tokens N]
"""

from __future__ import annotations

import argparse
import os

import lark

from constrained_serve import Engine, SamplingParams

GRAMMARS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "grammars")


class Evaluate(lark.Transformer):
    """Turns an arith.lark tree into a number."""

    def start(self, c):
        return c[0]

    def NUMBER(self, tok):
        return float(tok)

    def expr(self, c):
        return self._fold(c)

    def term(self, c):
        return self._fold(c)

    def factor(self, c):  # unary minus
        return -c[1]

    def power(self, c):
        return c[0] ** c[1]

    @staticmethod
    def _fold(c):
        value = c[0]
        for op, rhs in zip(c[1::2], c[2::2]):
            value = {"+": value + rhs, "-": value - rhs, "*": value * rhs, "/": value / rhs if rhs else float("nan")}[
                op
            ]
        return value


def read(name: str) -> str:
    with open(os.path.join(GRAMMARS, name)) as f:
        return f.read()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    params = SamplingParams(max_tokens=args.max_tokens)
    engine = Engine()

    arith = read("arith.lark")
    parser = lark.Lark(arith)
    questions = ["three times the sum of four and five", "half of 250, minus 7"]
    prompts = [[{"role": "user", "content": f"Write an arithmetic expression for: {q}"}] for q in questions]
    for q, r in zip(questions, engine.chat(prompts, params, grammar=arith)):
        if r.finish_reason != "stop":
            print(f"{q!r} -> {r.text!r} (cut at max_tokens)")
            continue
        value = Evaluate().transform(parser.parse(r.text))
        print(f"{q!r} -> {r.text!r} = {value:g}")

    sql = read("sql_select.lark")
    ask = "Write a SQL query: the names of the 5 most expensive products in the products table."
    [r] = engine.chat([[{"role": "user", "content": ask}]], params, grammar=sql)
    print(f"{ask!r}\n  -> {r.text!r}")
    if r.finish_reason == "stop":
        print("  parse tree:", lark.Lark(sql).parse(r.text).pretty().splitlines()[0], "...")


if __name__ == "__main__":
    main()
