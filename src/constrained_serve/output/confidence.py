"""Per-field confidence of a JSON output (``SamplingParams(field_confidence=True)``).

For each value of the parsed output (json_spans.scan gives each one's characters), the
probability the model gave to what it wrote there: the product, over the output tokens whose
text overlaps the value, of each token's probability under the model's raw distribution
(the sampled token's logprob, recorded by the sampler). A token the grammar forced was not
chosen by the model: it counts as certain. Token texts are placed by replaying the output
through the incremental detokenizer the engine used, so they line up with ``Result.text``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ..engine.detokenizer import IncrementalDetokenizer
from .json_spans import scan

__all__ = ["field_confidence", "token_offsets"]


def token_offsets(tokenizer: Any, prompt_tail: Sequence[int], ids: Sequence[int]) -> list[tuple[int, int]]:
    """Per output token, the character range of the output text it produced."""
    detok = IncrementalDetokenizer(tokenizer, list(prompt_tail))
    out, at = [], 0
    for t in ids:
        detok.push([t])
        out.append((at, len(detok.text)))
        at = len(detok.text)
    detok.flush()
    if out:
        out[-1] = (out[-1][0], len(detok.text))
    # A token whose bytes only became a character with a later token shares that token's range.
    for i in range(len(out) - 2, -1, -1):
        if out[i][0] == out[i][1]:
            out[i] = out[i + 1]
    return out


def field_confidence(
    text: str, offsets: list[tuple[int, int]], logprobs: Sequence[dict[int, float] | None], ids: Sequence[int]
) -> dict[str, float]:
    """{JSON path: probability} for every complete value of ``text``."""
    spans, _, _ = scan(text)
    per_token = [0.0 if lp is None else lp.get(t, 0.0) for t, lp in zip(ids, logprobs)]
    out: dict[str, float] = {}
    k = 0  # tokens are in text order, and so are span starts: walk both
    for span in spans:
        if not span.complete:
            continue
        while k < len(offsets) and offsets[k][1] <= span.start:
            k += 1
        total, j = 0.0, k
        while j < len(offsets) and offsets[j][0] < span.end:
            if offsets[j][1] > offsets[j][0]:
                total += per_token[j]
            j += 1
        out[span.path] = math.exp(total)
    return out
