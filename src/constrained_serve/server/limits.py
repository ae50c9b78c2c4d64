"""What a request body must pass before any route reads it (an ASGI middleware).

In order, each refusal an OpenAI error body, in milliseconds, before any parsing into
Pydantic models or tokenizing:

- a body over ``max_request_bytes`` (``--max-request-bytes``, default 4 MiB): 413, by its
  Content-Length before a byte is read, or as soon as the bytes read pass it;
- a body that is not UTF-8, nests JSON deeper than ``MAX_BODY_DEPTH``, is not JSON, or holds
  a lone UTF-16 surrogate (``"\\ud800"``, which no tokenizer can encode): 400 saying which;
- a ``model`` that is not the served name (``--served-model-name``): 404 ``model_not_found``,
  as OpenAI and vLLM answer. A body without ``model`` gets the served model.

The body read here is handed on to the app unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.responses import JSONResponse

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "MAX_BODY_DEPTH", "BodyGuard", "error_response"]

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
# Past the deepest schema a spec takes (grammar.spec.MAX_SCHEMA_DEPTH, 128) plus the request around it.
MAX_BODY_DEPTH = 160

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def error_response(
    status: int, message: str, kind: str = "invalid_request_error", code: str | None = None, param: str | None = None
) -> JSONResponse:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return JSONResponse(
        status_code=status, content={"error": {"message": message, "type": kind, "param": param, "code": code}}
    )


def _depth(body: bytes) -> int:
    """The deepest nesting of ``[`` / ``{`` in a JSON text (strings skipped), counted in C:
    the brackets inside strings are removed first by splitting on quotes."""
    deepest = depth = 0
    # Strings: an unescaped '"' toggles. Escaped quotes are rare; handle them exactly.
    in_string = False
    i, n = 0, len(body)
    while i < n:
        if in_string:
            j = body.find(b'"', i)
            if j < 0:
                return deepest
            k = j - 1
            while k >= i and body[k] == 0x5C:  # count the backslashes before the quote
                k -= 1
            if (j - 1 - k) % 2 == 0:
                in_string = False
            i = j + 1
            continue
        j = body.find(b'"', i)
        chunk = body[i:] if j < 0 else body[i:j]
        if b"[" in chunk or b"{" in chunk or b"]" in chunk or b"}" in chunk:
            for c in chunk:
                if c in (0x5B, 0x7B):
                    depth += 1
                    if depth > deepest:
                        deepest = depth
                elif c in (0x5D, 0x7D):
                    depth -= 1
        if j < 0:
            break
        in_string, i = True, j + 1
    return deepest


class BodyGuard:
    """The ASGI middleware (see module docstring) for POST requests."""

    def __init__(self, app: Any, max_request_bytes: int, model_names: frozenset[str]) -> None:
        self.app = app
        self.max_bytes = max_request_bytes
        self.model_names = model_names

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        refusal, body = await self._read(scope, receive)
        if refusal is None:
            refusal = self._check(body)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # http.disconnect, when the client goes

        await self.app(scope, replay, send)

    def _too_large(self, size: str) -> JSONResponse:
        return error_response(
            413,
            f"the request body ({size}) is larger than this server takes ({self.max_bytes} bytes; "
            "the server's --max-request-bytes)",
            code="request_too_large",
        )

    async def _read(self, scope: Scope, receive: Receive) -> tuple[JSONResponse | None, bytes]:
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    return error_response(400, "invalid Content-Length header"), b""
                if declared > self.max_bytes:
                    return self._too_large(f"{declared} bytes"), b""
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return error_response(400, "the client went away before sending the body"), b""
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_bytes:
                return self._too_large(f"over {self.max_bytes} bytes"), b""
            chunks.append(chunk)
            if not message.get("more_body", False):
                return None, b"".join(chunks)

    def _check(self, body: bytes) -> JSONResponse | None:
        if not body.strip():
            return None  # the route says what is missing
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as e:
            return error_response(
                400, f"the request body is not valid UTF-8 (byte {e.start}: {body[e.start : e.start + 1]!r})"
            )
        if _depth(body) > MAX_BODY_DEPTH:
            return error_response(400, f"the request body nests JSON deeper than {MAX_BODY_DEPTH} levels; flatten it")
        try:
            value = json.loads(text)
        except (ValueError, RecursionError) as e:
            return error_response(400, f"the request body is not valid JSON: {e}")
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            bad = e.object[e.start : e.end] if isinstance(e.object, str) else "?"
            return error_response(
                400,
                f"the request body holds a lone UTF-16 surrogate ({bad!r}), which is no character: "
                "escape characters outside the BMP as a surrogate pair, or send them as UTF-8",
            )
        except (ValueError, RecursionError):
            pass
        if isinstance(value, dict):
            model = value.get("model")
            if isinstance(model, str) and model not in self.model_names:
                return error_response(
                    404,
                    f"The model `{model[:200]}` does not exist. This server serves "
                    f"{', '.join(sorted(self.model_names))} (see /v1/models).",
                    code="model_not_found",
                    param="model",
                )
        return None


def default_served_name(engine: Any) -> str:
    """The model id clients see by default: the last part of the model the engine was asked
    for (a hub id's name, a folder's name, a GGUF file's stem), never a filesystem path."""
    from pathlib import PurePath

    asked = getattr(getattr(getattr(engine, "engine", engine), "config", None), "model", None)
    source = str(asked) if asked else (engine.model_path or "")
    name = PurePath(source.rstrip("/\\")).name if source else ""
    if name.lower().endswith(".gguf"):
        name = name[: -len(".gguf")]
    return name or "default"
