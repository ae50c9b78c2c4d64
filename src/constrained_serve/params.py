"""Sampling parameters and output specifications (what the output must look like)."""

from __future__ import annotations

import math
import numbers
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

OutputKind = Literal["json_schema", "json_object", "regex", "lark", "ebnf", "choices"]
GroundingUnit = Literal["words", "chars"]


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Validated on construction.

    ``seed`` makes a request's sampled output reproducible whatever else shares its batch.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0  # 0 (or -1, as in vLLM) = off
    top_p: float = 1.0
    min_p: float = 0.0  # keep tokens with p >= min_p * the top p (1: only the top token and its ties)
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
    # Log-probabilities of each prompt token given the tokens before it (k: also the k most
    # likely there), as vLLM's prompt_logprobs: Result.prompt_logprobs, None for the first
    # token. Such a request computes its whole prompt (no prefix-cache reuse). None: off.
    prompt_logprobs: int | None = None
    # Completions per prompt (vLLM/OpenAI ``n``): independent samples sharing the prompt's
    # KV through the prefix cache. The Result carries the first; Result.samples all n.
    n: int = 1
    # Deadlines of this request's grammar work (None: the engine's grammar_compile_timeout_s,
    # 10 s, and grammar_mask_timeout_s: 0.5 s with llguidance, 3 s with xgrammar). A compile,
    # or one step's matcher work (a mask, accepting the sampled token, the forced tokens),
    # that runs longer is killed and the
    # request fails alone with a GrammarError; the rest of the batch goes on.
    compile_timeout_s: float | None = None
    mask_timeout_s: float | None = None
    # Result.field_confidence for JSON outputs: per JSON path, the probability the model gave
    # to the value it wrote (the product over the value's tokens of their raw probability;
    # forced tokens count as certain). Records the sampled tokens' logprobs (Result.logprobs
    # too): a log-softmax of each row's logits per step, ~1-2 ms at 64 rows on CPU.
    field_confidence: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (and normalize ``stop``/``stop_token_ids`` to tuples); raises a
        ValueError naming the field. Runs on construction and again at submit, so a field
        changed after construction is checked too."""
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else _items(self.stop)
        if stop is None or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop = stop
        ids = () if self.stop_token_ids is None else _items(self.stop_token_ids)
        if ids is None or not all(_is_int(t) and t >= 0 for t in ids):
            raise ValueError(f"stop_token_ids must be a list of token ids (integers >= 0), got {self.stop_token_ids!r}")
        self.stop_token_ids = tuple(int(t) for t in ids)
        _check_int("max_tokens", self.max_tokens, 1)
        _check_real("temperature", self.temperature, 0.0)
        _check_real("top_p", self.top_p, 0.0, 1.0, "in (0, 1]", open_low=True)
        _check_int("top_k", self.top_k, -1, "an integer in [-1, 2**31) (0 or -1 disables it)", hi=2**31 - 1)
        if self.top_k == -1:  # vLLM's "off"
            self.top_k = 0
        _check_real("min_p", self.min_p, 0.0, 1.0, "in [0, 1]")
        if self.seed is not None:  # mixed into 64-bit per-step seeds: a wider one would wrap
            _check_int("seed", self.seed, -(2**63), "None or an integer in [-2**63, 2**64)", hi=2**64 - 1)
        if not isinstance(self.field_confidence, bool):
            raise ValueError(f"field_confidence must be True or False, got {self.field_confidence!r}")
        if type(self.ignore_eos).__name__ == "bool_":  # numpy's bool
            self.ignore_eos = bool(self.ignore_eos)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        _check_real("repetition_penalty", self.repetition_penalty, 0.0, None, "> 0 (1 disables it)", open_low=True)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_real(name, getattr(self, name), -2.0, 2.0, "in [-2, 2] (0 disables it)")
        _check_int("n", self.n, 1, "an integer in [1, 256]", hi=256)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0, "None or an integer in [0, 20]", hi=20)
        for name in ("compile_timeout_s", "mask_timeout_s"):
            if getattr(self, name) is not None:
                _check_real(
                    name, getattr(self, name), 0.0, 3600.0, "None or a number of seconds in (0, 3600]", open_low=True
                )
                setattr(self, name, float(getattr(self, name)))
        # Plain Python numbers from here on (a numpy seed overflowed the per-step seed mix).
        for name in ("max_tokens", "top_k", "seed", "logprobs", "prompt_logprobs", "n"):
            if getattr(self, name) is not None:
                setattr(self, name, int(getattr(self, name)))
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            setattr(self, name, float(getattr(self, name)))

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _items(v: Any) -> tuple | None:
    """A list, tuple, set, range, array or generator as a tuple; None for anything else."""
    if isinstance(v, (str, bytes, dict)):
        return None
    try:
        return tuple(v)
    except TypeError:
        return None


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _check_int(name: str, v: Any, lo: int | None, what: str | None = None, hi: int | None = None) -> None:
    if not _is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ValueError(f"{name} must be {what or f'an integer >= {lo}'}, got {v!r}")


def _check_real(
    name: str,
    v: Any,
    lo: float,
    hi: float | None = None,
    what: str | None = None,
    open_low: bool = False,
    open_high: bool = False,
) -> None:
    """A finite number in [lo, hi] (or with open ends); bools and strings are refused."""
    try:
        ok = isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
        # The sampler works in float32: the value must survive that too (1e39 becomes inf,
        # top_p=1e-46 becomes 0, which filtered out every token).
        v32 = struct.unpack("f", struct.pack("f", float(v)))[0] if ok else v
        ok = ok and math.isfinite(v32)
    except OverflowError:  # an int too large for a float (10**400), or a float for float32
        ok = False
    ok = ok and all(
        (x > lo if open_low else x >= lo) and (hi is None or (x < hi if open_high else x <= hi)) for x in (v, v32)
    )
    if not ok:
        raise ValueError(f"{name} must be a finite number {what or f'>= {lo}'}, got {v!r}")


@dataclass(frozen=True)
class Grounding:
    """The source text grounded string fields quote (grammar/grounding.py): such a field may
    only take a verbatim span of one of ``sources`` (a chat's user messages: a span never
    crosses two of them). Offsets in ``Result.spans`` count characters of ``text``, the
    sources joined by a blank line.

    ``unit`` "words": a span starts and ends at word boundaries (a run of letters, digits or
    ``_`` is never cut; every other character is a unit of its own); "chars": anywhere. A
    field's ``"x-grounded": "chars"`` (or ``"words"``) overrides it. ``all_strings``: every
    plain string field is grounded (``grounded=True``), not only the ones marked
    ``"x-grounded"`` in the schema."""

    sources: tuple[str, ...]
    unit: GroundingUnit = "words"
    all_strings: bool = False

    SEPARATOR = "\n\n"

    @property
    def text(self) -> str:
        return self.SEPARATOR.join(self.sources)

    @property
    def key(self) -> str:
        """What tells two groundings apart in the compile cache: a digest of the sources."""
        import hashlib

        h = hashlib.sha256(f"{self.unit}|{self.all_strings}|{len(self.sources)}".encode())
        for s in self.sources:
            h.update(b"\x00" + s.encode("utf-8", "surrogatepass"))
        return h.hexdigest()


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
    # Grounded string fields and the text they quote (a JSON Schema only; None: none).
    grounding: Grounding | None = None

    @property
    def is_json(self) -> bool:
        return self.kind in ("json_schema", "json_object")
