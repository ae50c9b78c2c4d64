"""Pydantic extraction: every output parses into an `Invoice`, guaranteed by the grammar.

python examples/pydantic_extraction.py [--max-tokens N]
"""

from __future__ import annotations

import argparse
from typing import Literal

from pydantic import BaseModel, Field

from constrained_serve import Engine, SamplingParams


class Invoice(BaseModel):
    vendor: str = Field(max_length=40, description="who sent the invoice")
    invoice_number: str = Field(max_length=20)
    total: float = Field(ge=0)
    currency: Literal["EUR", "USD", "GBP"]
    paid: bool


TEXTS = [
    "INVOICE 2024-0193. Northwind Office Supply. 12 boxes of A4 paper. Total due 561.00 EUR by 15 March.",
    "Bill #C-3302 from City Water Services: 86.40 USD for January to March. Paid in full, thank you.",
    "Invoice no. 7781, Bright Cleaning Ltd, office cleaning October, 1200.00 GBP, payment due in 30 days.",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()

    engine = Engine()  # the default model: SmolLM2-135M-Instruct
    system = "Extract the invoice fields from the text as JSON."
    conversations = [[{"role": "system", "content": system}, {"role": "user", "content": t}] for t in TEXTS]
    results = engine.chat(conversations, SamplingParams(max_tokens=args.max_tokens), schema=Invoice)
    for text, r in zip(TEXTS, results):
        print(text)
        if r.parsed is not None:
            invoice: Invoice = r.parsed  # a real Invoice instance
            print(f"  -> {invoice!r}")
        else:
            print(f"  -> no Invoice ({r.finish_reason}): {r.error}")


if __name__ == "__main__":
    main()
