"""An OpenAI-compatible HTTP server over an AsyncEngine (FastAPI + uvicorn).

    constrained-serve serve [--model M] [--host 127.0.0.1] [--port 8000] [--api-key KEY]

``/v1/chat/completions``, ``/v1/completions`` (both with ``stream`` as server-sent events),
``/v1/responses`` (responses.py), ``/v1/models``, ``/health``. Every request from every client joins the same continuous
batches (one stepper thread, see async_engine.py). Bad input is a 400 with an OpenAI-style
error body naming the problem; a request that fails while it decodes fails alone (its
response says why), and the server goes on. A client that disconnects mid-stream has its
request aborted at the next step and its pages freed.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import GrammarError, PromptTooLongError
from ..result import Result
from . import protocol as P
from . import responses as R
from .limits import DEFAULT_MAX_REQUEST_BYTES, BodyGuard, default_served_name
from .tools import ToolDeltas

if TYPE_CHECKING:
    from ..async_engine import AsyncEngine, Stream

logger = logging.getLogger(__name__)

__all__ = ["API_KEY_ENV", "build_app"]

API_KEY_ENV = "CONSTRAINED_SERVE_API_KEY"


def _error(
    status: int, message: str, kind: str = "invalid_request_error", code: str | None = None, param: str | None = None
) -> JSONResponse:
    return JSONResponse(
        status_code=status, content={"error": {"message": message, "type": kind, "param": param, "code": code}}
    )


def _failure(results: list[Result]) -> JSONResponse | None:
    """A response for results that failed while they decoded (None if none did)."""
    failed = [
        s for r in results for s in (r.samples or [r]) if r.finish_reason == "abort" or s.finish_reason == "abort"
    ]
    if not failed:
        return None
    r = failed[0]
    if r.error_type in ("PromptTooLongError", "GrammarError", "ValueError", "TypeError"):
        return _error(400, f"{r.error_type}: {r.error}", code=r.error_type)
    return _error(
        500, f"the request failed while decoding: {r.error_type}: {r.error}", kind="server_error", code=r.error_type
    )


def build_app(
    engine: AsyncEngine,
    model_name: str | None = None,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    """The FastAPI app over ``engine`` (an AsyncEngine). ``api_key`` (or the environment
    variable CONSTRAINED_SERVE_API_KEY): every request must carry ``Authorization: Bearer
    <key>``, else 401. ``model_name``: the id clients see and must send (default: the
    model's last path part); bodies are checked first (limits.py)."""
    app = FastAPI(title="constrained-serve", version="0.1.0")
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
    name = model_name or default_served_name(engine)
    app.add_middleware(BodyGuard, max_request_bytes=max_request_bytes, model_names=frozenset({name}))
    tokenizer = engine.tokenizer
    started = int(time.time())

    @app.middleware("http")
    async def check_key(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if key is not None and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {key}".encode()):
                return _error(401, "missing or wrong API key (Authorization: Bearer <key>)", code="invalid_api_key")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}" for e in exc.errors()
        )
        return _error(400, f"invalid request: {problems}")

    @app.exception_handler(ValueError)  # GrammarError, PromptTooLongError, bad params: the caller's input
    async def bad_value(request: Request, exc: ValueError) -> JSONResponse:
        code = type(exc).__name__ if isinstance(exc, (GrammarError, PromptTooLongError)) else None
        return _error(400, str(exc), code=code)

    @app.exception_handler(TypeError)
    async def bad_type(request: Request, exc: TypeError) -> JSONResponse:
        return _error(400, str(exc))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": name, "object": "model", "created": started, "owned_by": "constrained-serve"}],
        }

    @app.post("/v1/chat/completions")
    async def chat(req: P.ChatCompletionRequest):
        params, specs = P.sampling_params(req), P.spec_kwargs(req)
        _check_messages(req.messages)
        if req.stream:
            stream = await engine.open_stream(req.messages, params, **specs)
            tools = ToolDeltas(tokenizer) if req.tools and req.tool_choice != "none" else None
            return _streamed("chat", stream, name, _include_usage(req), tools)
        results = await engine.chat(req.messages, params, **specs)
        return _failure(results) or P.chat_response(results, name, tokenizer, req.top_logprobs)

    @app.post("/v1/completions")
    async def completions(req: P.CompletionRequest):
        params, specs = P.sampling_params(req), P.spec_kwargs(req)
        prompts = _prompts(req.prompt)
        if req.stream:
            if len(prompts) != 1:
                raise ValueError("stream takes one prompt")
            stream = await engine.open_stream(prompts[0], params, **specs)
            return _streamed("completion", stream, name, _include_usage(req))
        results = await engine.generate(prompts, params, **specs)
        return _failure(results) or P.completion_response(results, name, tokenizer)

    @app.post("/v1/responses")
    async def responses(req: R.ResponsesRequest):
        return await R.respond(req, engine, name)

    @app.exception_handler(StarletteHTTPException)  # an unknown path or method: an OpenAI error body too
    async def not_found(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=str(exc.status_code))

    @app.exception_handler(Exception)  # a bug of ours: still an OpenAI error body, and logged
    async def failed(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("%s %s failed", request.method, request.url.path)
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error")

    return app


def _check_messages(messages: list[dict[str, Any]]) -> None:
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}]: 'role' must be a string")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise ValueError(f"messages[{i}]: only text content parts are supported")
            m["content"] = "".join(p.get("text", "") for p in content)
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"messages[{i}]: 'content' must be a string or a list of text parts")


def _prompts(prompt: Any) -> list[Any]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [prompt]  # one prompt of token ids
    return list(prompt)


def _include_usage(req: Any) -> bool:
    return bool((req.stream_options or {}).get("include_usage"))


def _streamed(
    kind: str, stream: Stream, model: str, include_usage: bool, tools: ToolDeltas | None = None
) -> StreamingResponse:
    rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())

    async def events() -> AsyncIterator[str]:
        # Bad input raised before the first byte (open_stream: a 400 from the handlers); a
        # failure while decoding is told in-stream, as an error event.
        if kind == "chat":
            yield _sse(P.chunk(kind, rid, model, created, None, None, first=True))
        async for delta, result in stream.events():
            if result is None:
                calls: list[dict[str, Any]] = []
                if tools is not None:  # a chat with tools: text until the calls start, then calls
                    delta, calls = tools.feed(delta)
                if delta:
                    yield _sse(P.chunk(kind, rid, model, created, delta, None))
                for call in calls:
                    yield _sse(P.chunk(kind, rid, model, created, None, None, tool_calls=[call]))
                continue
            if tools is not None and result.finish_reason != "abort":
                rest = tools.finish()
                if rest:
                    yield _sse(P.chunk(kind, rid, model, created, rest, None))
            if result.finish_reason == "abort":
                yield _sse(
                    {
                        "error": {
                            "message": f"{result.error_type}: {result.error}",
                            "type": "server_error",
                            "code": result.error_type,
                        }
                    }
                )
            else:
                yield _sse(P.chunk(kind, rid, model, created, None, P.finish_reason(result)))
                if include_usage:
                    yield _sse(
                        {
                            "id": rid,
                            "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                            "created": created,
                            "model": model,
                            "choices": [],
                            "usage": P.usage_of([result]),
                        }
                    )
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
