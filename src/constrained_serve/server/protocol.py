"""The OpenAI wire format: request bodies (validated with Pydantic, unknown fields refused)
turned into SamplingParams and output specs, and Results turned into response bodies.

Structured outputs come as OpenAI's ``response_format`` (``json_object``, ``json_schema`` with
``strict``), or as vLLM names them for the other specs, in ``extra_body``: ``guided_json``,
``guided_regex``, ``guided_grammar``, ``guided_choice`` (and ``guided_decoding_backend``), or
the newer ``structured_outputs: {"json" | "regex" | "grammar" | "choice": ...}``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..params import SamplingParams
from ..result import Result
from .tools import message_of, tool_kwargs
from .vllm_fields import vllm_spec_fields

__all__ = [
    "ChatCompletionRequest",
    "CompletionRequest",
    "chat_response",
    "completion_response",
    "sampling_params",
    "spec_kwargs",
    "usage_of",
]


class _Body(BaseModel):
    """Fields both endpoints take. Unknown fields are refused (a 400 naming them), so a
    client never believes a setting was applied that was not."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(default=1, ge=1, le=256)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    # structured outputs, vLLM's names
    guided_json: Any = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None  # vllm_fields.py: "" or free whitespace
    structured_outputs: dict[str, Any] | None = None
    # constrained-serve's own: JSON Schema objects that do not say additionalProperties stay
    # open, as JSON Schema literally reads them (default: closed; see docs/api.md)
    json_open_objects: bool = False
    # Grounded string fields (docs/api.md): True or "words" / "chars" grounds every plain string
    # field of the schema; source_text is the text they quote (default: the user messages, or
    # the prompt). The response's choices carry "spans": {JSON path: [start, end]}.
    grounded: bool | Literal["words", "chars"] | None = None
    source_text: str | None = None


class ChatCompletionRequest(_Body):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    # Tool calling (server/tools.py); the deprecated functions / function_call are refused.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: passed to the chat template


class CompletionRequest(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    response_format: dict[str, Any] | None = None


def _refuse(what: str) -> ValueError:
    return ValueError(f"{what} is not supported by this server")


def sampling_params(req: _Body) -> SamplingParams:
    """The request's SamplingParams (ValueError naming a bad field)."""
    if req.logit_bias:
        raise _refuse("logit_bias")
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens or req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        if req.top_logprobs and not req.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
    else:
        if req.echo:
            raise _refuse("echo")
        if req.suffix:
            raise _refuse("suffix")
        if req.best_of not in (None, 1, req.n):
            raise _refuse("best_of other than n")
        max_tokens = req.max_tokens or 16  # the Completions API's default
        logprobs = req.logprobs
    kw: dict[str, Any] = dict(n=req.n, seed=req.seed, ignore_eos=req.ignore_eos, logprobs=logprobs)
    if max_tokens is not None:
        kw["max_tokens"] = max_tokens
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    ):
        if getattr(req, name) is not None:
            kw[name] = getattr(req, name)
    if req.stop is not None:
        kw["stop"] = [req.stop] if isinstance(req.stop, str) else req.stop
    if req.stop_token_ids:
        kw["stop_token_ids"] = req.stop_token_ids
    return SamplingParams(**kw)


def spec_kwargs(req: _Body) -> dict[str, Any]:
    """The output spec as Engine.generate's keywords ({} for free text)."""
    specs: dict[str, Any] = {}
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.get("type") != "text":
        specs["response_format"] = rf
    so = dict(req.structured_outputs or {})
    unknown = set(so) - {"json", "regex", "grammar", "choice", "json_object"}
    if unknown:
        raise ValueError(f"structured_outputs: unknown key(s) {sorted(unknown)} (json, regex, grammar, choice)")
    for name, value in (
        ("schema", req.guided_json if req.guided_json is not None else so.get("json")),
        ("regex", req.guided_regex or so.get("regex")),
        ("grammar", req.guided_grammar or so.get("grammar")),
        ("choices", req.guided_choice or so.get("choice")),
    ):
        if value is not None:
            specs[name] = value
    if so.get("json_object"):
        specs["response_format"] = {"type": "json_object"}
    if len(specs) > 1:
        raise ValueError(f"give one output constraint, got {sorted(specs)}")
    if req.guided_decoding_backend:
        specs["grammar_backend"] = req.guided_decoding_backend
    if req.json_open_objects and specs:
        specs["json_open_objects"] = True
    if req.grounded not in (None, False):
        specs["grounded"] = req.grounded
    if req.source_text is not None:
        specs["source_text"] = req.source_text
    vllm_spec_fields(req, specs)
    if isinstance(req, ChatCompletionRequest):
        specs.update(tool_kwargs(req))
    return specs


def usage_of(results: list[Result]) -> dict[str, Any]:
    prompt = sum(r.usage.prompt_tokens for r in results)
    completion = sum(r.usage.completion_tokens for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(r.usage.cached_tokens for r in results)},
        # constrained-serve's own: output tokens the grammar forced (no decode step each)
        "completion_tokens_details": {"forced_tokens": sum(r.usage.forced_tokens for r in results)},
    }


def finish_reason(r: Result) -> str:
    if r.finish_reason == "length":
        return "length"
    return "tool_calls" if r.tool_calls else "stop"


def _token_logprobs(r: Result, tokenizer: Any, k: int) -> list[dict[str, Any]]:
    """OpenAI's logprobs.content: per output token its text, logprob and top_logprobs. A token
    the grammar forced was never scored: certain under the grammar, logprob 0."""
    out = []
    for tid, entry in zip(r.token_ids, r.logprobs or []):
        text = tokenizer.decode([tid])
        if entry is None:
            out.append({"token": text, "logprob": 0.0, "bytes": list(text.encode()), "top_logprobs": []})
            continue
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
        out.append(
            {
                "token": text,
                "logprob": entry[tid],
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": (t := tokenizer.decode([i])), "logprob": lp, "bytes": list(t.encode())} for i, lp in top
                ],
            }
        )
    return out


def chat_response(results: list[Result], model: str, tokenizer: Any, top_logprobs: int | None) -> dict[str, Any]:
    [res] = results
    samples = res.samples or [res]
    choices = []
    for i, r in enumerate(samples):
        choice: dict[str, Any] = {
            "index": i,
            "message": message_of(r),
            "logprobs": None,
            "finish_reason": finish_reason(r),
        }
        if r.logprobs is not None:
            choice["logprobs"] = {"content": _token_logprobs(r, tokenizer, top_logprobs or 0)}
        if r.spans is not None:  # constrained-serve's own: where each grounded value stands
            choice["spans"] = {path: list(span) for path, span in r.spans.items()}
        choices.append(choice)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage_of([res]),
    }


def completion_response(results: list[Result], model: str, tokenizer: Any) -> dict[str, Any]:
    choices = []
    for res in results:
        for r in res.samples or [res]:
            choice: dict[str, Any] = {
                "index": len(choices),
                "text": r.text,
                "logprobs": None,
                "finish_reason": finish_reason(r),
            }
            if r.logprobs is not None:
                content = _token_logprobs(r, tokenizer, 20)
                choice["logprobs"] = {
                    "tokens": [c["token"] for c in content],
                    "token_logprobs": [c["logprob"] for c in content],
                    "top_logprobs": [{t["token"]: t["logprob"] for t in c["top_logprobs"]} for c in content],
                }
            if r.spans is not None:
                choice["spans"] = {path: list(span) for path, span in r.spans.items()}
            choices.append(choice)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage_of(results),
    }


def chunk(
    kind: Literal["chat", "completion"],
    rid: str,
    model: str,
    created: int,
    delta: str | None,
    finish: str | None,
    first: bool = False,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One streamed chunk (chat.completion.chunk or text_completion); ``tool_calls``: OpenAI's
    tool-call deltas (server/tools.py)."""
    if kind == "chat":
        d: dict[str, Any] = {"role": "assistant", "content": ""} if first else ({"content": delta} if delta else {})
        if tool_calls:
            d["tool_calls"] = tool_calls
        choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}],
    }
