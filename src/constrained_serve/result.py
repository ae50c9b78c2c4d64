"""What ``generate`` returns: one ``Result`` per input, in input order."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served by the prefix cache
    completion_tokens: int = 0  # every output token, forced ones included
    forced_tokens: int = 0  # output tokens the grammar forced (fast-forward, no decode step)

    def to_dict(self) -> dict[str, int]:
        return dict(
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            completion_tokens=self.completion_tokens,
            forced_tokens=self.forced_tokens,
        )


@dataclass
class ToolCall:
    """One tool call of a chat with ``tools`` (see tools/): the function's name and its
    arguments, which the grammar held to the function's parameters schema and which were
    validated against it once more."""

    id: str  # "call_<hex>", unique per call
    name: str
    arguments: dict[str, Any]  # parsed
    arguments_json: str  # the same, as a JSON string (OpenAI's function.arguments)

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's message.tool_calls entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments_json}}


@dataclass
class Result:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort"
    usage: Usage = field(default_factory=Usage)
    json: Any = None  # the parsed JSON value, for JSON outputs that completed
    parsed: Any = None  # the Pydantic instance (or regex/grammar text) when complete
    error: str | None = None  # why json/parsed are missing (truncated, invalid spec, ...)
    error_type: str | None = None
    index: int = 0  # position in the input list
    prompt: Any = None
    # As in vLLM: the stop string or stop token id (SamplingParams.stop / stop_token_ids)
    # that ended the output; None when EOS, the grammar's end or a limit ended it.
    stop_reason: int | str | None = None
    # With SamplingParams(logprobs=k): one entry per token_ids entry, {token id: logprob} for
    # the sampled token then the k most likely (raw model distribution); None for a token
    # the grammar forced (never scored; Engine(fast_forward=False) samples and scores them).
    logprobs: list[dict[int, float] | None] | None = None
    # With SamplingParams(n > 1): the n completions, each a Result of its own (samples[0] has
    # the same fields as this one). This Result's usage counts them all (prompt once).
    samples: list[Result] | None = None
    # With SamplingParams(prompt_logprobs=k): per prompt token {token id: logprob, then the k
    # most likely}, given the tokens before it (raw model distribution); None for the first.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # With SamplingParams(field_confidence=True), for a complete JSON output: per JSON path
    # ("$", "$.name", "$.items[0]", ...) the probability the model gave to the value written
    # there: the product over the tokens overlapping the value of their raw probability
    # (forced tokens count as certain, probability 1).
    field_confidence: dict[str, float] | None = None
    # A chat with tools (Engine.chat(tools=...)): the calls the model made, None when it made
    # none (it answered in text, tool_choice "auto" or "none"). ``text`` keeps the output as
    # written, calls included; ``content`` is its text part: all of it without calls, the text
    # before the first call with them (None when empty). Both None in a chat without tools.
    tool_calls: list[ToolCall] | None = None
    content: str | None = None
    # Grounded fields (grounded=True, "x-grounded" in the schema; grammar/grounding.py): the
    # text they quote (a chat's user messages joined by a blank line, generate's source_text
    # or prompt), and for a complete output, per JSON path of each non-empty grounded value,
    # its first occurrence there as character offsets: source_text[start:end] == the value.
    source_text: str | None = None
    spans: dict[str, tuple[int, int]] | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_reason == "stop"

    def __repr__(self) -> str:
        try:
            from .output.display import result_repr_text
        except ImportError:  # display helpers not available: a plain, still useful repr
            return (
                f"Result(finish_reason={self.finish_reason!r}, text={self.text[:80]!r}, "
                f"usage={self.usage}, error={self.error!r})"
            )
        return result_repr_text(self)

    def _repr_html_(self) -> str:
        from .output.display import result_repr_html

        return result_repr_html(self)
