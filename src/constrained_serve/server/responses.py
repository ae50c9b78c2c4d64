"""OpenAI's Responses API, ``POST /v1/responses``, over the AsyncEngine's public API.

Stateless: nothing is stored (``store`` is accepted and ignored), so ``previous_response_id``
and ``conversation`` are refused with a 400 naming them; send the history in ``input``.

- ``input``: a string (one user message) or a list of messages (``{"role", "content"}``, with
  or without ``"type": "message"``; content a string or ``input_text``/``output_text``
  parts); ``instructions`` becomes a system message in front.
- ``text.format``: ``text`` (free text), ``json_object``, or ``json_schema`` (``name``,
  ``schema``, ``strict``) -- the same specs as chat's ``response_format``, objects closed
  the same way (docs/api.md). ``client.responses.parse(text_format=Model)`` sends the last.
- ``max_output_tokens``, ``temperature``, ``top_p``; an output cut at ``max_output_tokens``
  has ``status: "incomplete"`` and ``incomplete_details.reason: "max_output_tokens"``.
- ``stream: true``: the typed event stream (``response.created``, ``response.in_progress``,
  ``response.output_item.added``, ``response.content_part.added``,
  ``response.output_text.delta``..., ``response.output_text.done``,
  ``response.content_part.done``, ``response.output_item.done``, then
  ``response.completed``, or ``response.incomplete`` / ``response.failed``), as server-sent
  events with ``event:`` lines and a ``sequence_number`` each.
- Function ``tools`` with ``tool_choice`` (``"auto"``, the default, ``"required"``, ``"none"``,
  or ``{"type": "function", "name"}``) and ``parallel_tool_calls``: the calls are
  ``function_call`` output items that always parse and match their parameters; earlier calls
  and their results come back in ``input`` as ``function_call`` / ``function_call_output``
  items (server/responses_tools.py). A stream sends the text before the calls as text deltas,
  then each call as ``response.output_item.added``, ``response.function_call_arguments.delta``
  / ``.done`` and ``response.output_item.done``.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ..params import SamplingParams
from ..result import Result
from .responses_stream import events, status_of, text_part
from .responses_tools import call_item, chat_tool_kwargs, history_item, is_tool_item
from .tools import ToolDeltas

if TYPE_CHECKING:
    from ..async_engine import AsyncEngine

__all__ = ["ResponsesRequest", "respond"]


class ResponsesRequest(BaseModel):
    """The body of ``POST /v1/responses``. Unknown fields are refused (400), as on the other
    endpoints, so a client never believes a setting was applied that was not."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None  # accepted; nothing is stored
    metadata: dict[str, Any] | None = None
    user: str | None = None
    truncation: str | None = None
    previous_response_id: str | None = None  # refused: stateless
    conversation: Any = None  # refused: stateless
    background: bool | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    # constrained-serve's own (and vLLM's) extras, through extra_body
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    json_open_objects: bool = False


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """``instructions`` and ``input`` as chat messages (ValueError naming a bad item)."""
    out: list[dict[str, Any]] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return [*out, {"role": "user", "content": req.input}]
    for i, item in enumerate(req.input):
        kind = item.get("type", "message")
        if is_tool_item(item):
            history_item(i, item, out)
            continue
        if kind != "message":
            raise ValueError(
                f"input[{i}]: items of type {kind!r} are not supported (message, function_call, function_call_output)"
            )
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise ValueError(f"input[{i}]: 'role' must be user, assistant, system or developer, got {role!r}")
        content = item.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
                    got = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ValueError(f"input[{i}].content[{j}]: only text parts are supported, got {got!r}")
                texts.append(str(part.get("text", "")))
            content = "".join(texts)
        elif not isinstance(content, str):
            raise ValueError(f"input[{i}]: 'content' must be a string or a list of text parts")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    if not out:
        raise ValueError("input: give at least one message")
    return out


def _check(req: ResponsesRequest) -> None:
    if req.previous_response_id is not None:
        raise ValueError(
            "previous_response_id is not supported: this server stores no responses (store is ignored); "
            "send the earlier turns in input"
        )
    if req.conversation is not None:
        raise ValueError("conversation is not supported: this server stores no conversations; send the turns in input")
    if req.background:
        raise ValueError("background is not supported by this server")
    if req.top_logprobs:
        raise ValueError("top_logprobs is not supported on /v1/responses")


def _params(req: ResponsesRequest) -> SamplingParams:
    kw: dict[str, Any] = {"seed": req.seed}
    if req.max_output_tokens is not None:
        kw["max_tokens"] = req.max_output_tokens
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        if getattr(req, name) is not None:
            kw[name] = getattr(req, name)
    return SamplingParams(**kw)


def _specs(req: ResponsesRequest) -> dict[str, Any]:
    """``text.format`` as Engine.chat's keywords ({} for free text)."""
    text = dict(req.text or {})
    unknown = set(text) - {"format", "verbosity"}
    if unknown:
        raise ValueError(f"text: unknown key(s) {sorted(unknown)} (format, verbosity)")
    fmt = text.get("format")
    if fmt is None:
        return {}
    if not isinstance(fmt, dict) or "type" not in fmt:
        raise ValueError("text.format: expected {'type': 'text' | 'json_object' | 'json_schema', ...}")
    kind = fmt["type"]
    if kind == "text":
        return {}
    specs: dict[str, Any]
    if kind == "json_object":
        specs = {"response_format": {"type": "json_object"}}
    elif kind == "json_schema":
        if "schema" not in fmt:
            raise ValueError("text.format: json_schema needs 'schema'")
        js = {"name": fmt.get("name", "output"), "schema": fmt["schema"], "strict": fmt.get("strict")}
        specs = {"response_format": {"type": "json_schema", "json_schema": js}}
    else:
        raise ValueError(f"text.format: unknown type {kind!r} (text, json_object or json_schema)")
    if req.json_open_objects:
        specs["json_open_objects"] = True
    return specs


def _error(status: int, message: str, kind: str, code: str | None) -> JSONResponse:
    return JSONResponse(
        status_code=status, content={"error": {"message": message, "type": kind, "param": None, "code": code}}
    )


class _Builder:
    """The response object of one request, as it stands (in progress, then final)."""

    def __init__(self, req: ResponsesRequest, model: str) -> None:
        self.req = req
        self.model = model
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _text_config(self) -> dict[str, Any]:
        fmt = dict((self.req.text or {}).get("format") or {"type": "text"})
        return {"format": fmt}

    def message(self, text: str | None, status: str) -> dict[str, Any]:
        """The output message item; ``text`` None: just added, no content part yet."""
        content = [] if text is None else [text_part(text)]
        return {"id": self.item_id, "type": "message", "role": "assistant", "status": status, "content": content}

    def response(self, status: str, result: Result | None = None) -> dict[str, Any]:
        req = self.req
        out: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.model,
            "output": [],
            "parallel_tool_calls": bool(req.parallel_tool_calls) if req.parallel_tool_calls is not None else True,
            "previous_response_id": None,
            "temperature": req.temperature,
            "text": self._text_config(),
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [],
            "top_p": req.top_p,
            "truncation": req.truncation or "disabled",
            "usage": None,
            "user": req.user,
            "metadata": req.metadata or {},
            "store": False,  # nothing is stored, whatever the request said
        }
        if result is None:
            return out
        if status == "failed":
            out["error"] = {"code": "server_error", "message": f"{result.error_type}: {result.error}"}
        else:
            item_status = "incomplete" if status == "incomplete" else "completed"
            text = result.content if result.tool_calls else result.text
            out["output"] = [self.message(text, item_status)] if text or not result.tool_calls else []
            out["output"] += [call_item(c) for c in result.tool_calls or []]
        if status == "incomplete":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        out["completed_at"] = int(time.time()) if status == "completed" else None
        u = result.usage
        out["usage"] = {
            "input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens,
        }
        return out


async def respond(req: ResponsesRequest, engine: AsyncEngine, model: str) -> Any:
    """The response (a dict), the event stream, or an error body for a request that failed
    while it decoded. Bad input raises ValueError/TypeError (the app's 400 handlers)."""
    _check(req)
    messages, params, specs = _messages(req), _params(req), _specs(req)
    tools = chat_tool_kwargs(req.tools, req.tool_choice, req.parallel_tool_calls)
    specs.update(tools)
    builder = _Builder(req, model)
    if req.stream:
        stream = await engine.open_stream(messages, params, **specs)
        deltas = ToolDeltas(engine.tokenizer) if tools and tools.get("tool_choice") != "none" else None
        return StreamingResponse(events(builder, stream, deltas), media_type="text/event-stream")
    [result] = await engine.chat(messages, params, **specs)
    if result.finish_reason == "abort":
        if result.error_type in ("PromptTooLongError", "GrammarError", "ValueError", "TypeError"):
            return _error(400, f"{result.error_type}: {result.error}", "invalid_request_error", result.error_type)
        message = f"the request failed while decoding: {result.error_type}: {result.error}"
        return _error(500, message, "server_error", result.error_type)
    return builder.response(status_of(result), result)
