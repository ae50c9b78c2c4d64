"""Sampling parameters and output specifications (what the output must look like)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

OutputKind = Literal["json_schema", "json_object", "regex", "lark", "ebnf", "choices"]


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Validated on construction.

    ``seed`` makes a request's sampled output reproducible whatever else shares its batch.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    # As in vLLM/OpenAI, applied to the logits before the grammar mask and temperature.
    # repetition_penalty: > 1 discourages every token already in the prompt or output
    # (positive logits divided by it, negative ones multiplied); presence_penalty subtracts
    # a constant from each token already in the output, frequency_penalty that much per use.
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Log-probabilities of each sampled token (0) and of the k most likely tokens (k >= 1),
    # from the model's raw distribution: before penalties, the grammar mask and temperature
    # (vLLM's default "raw_logprobs"). None: off.
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not (0.0 <= self.min_p < 1.0):
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be None or an integer in [0, 20], got {self.logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2] (0 disables it), got {getattr(self, name)!r}")

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class OutputSpec:
    """A normalized output constraint, built by ``grammar.spec.make_output_spec``.

    ``text`` is canonical (sorted-key JSON for schemas) so it can key the compile cache.
    ``python_type`` is the Pydantic model / type to parse into, when the user gave one.
    """

    kind: OutputKind
    text: str
    python_type: Any = field(default=None, compare=False, hash=False)
    whitespace: bool = False  # allow free whitespace / indentation in JSON
    strict: bool = True  # refuse schema features a backend would silently approximate

    @property
    def is_json(self) -> bool:
        return self.kind in ("json_schema", "json_object")
