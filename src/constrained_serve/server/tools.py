"""Tool calling on the wire (OpenAI's chat completions): the request's ``tools``,
``tool_choice`` and ``parallel_tool_calls`` as ``Engine.chat``'s keywords, a Result's calls as
``message.tool_calls`` with ``finish_reason: "tool_calls"``, and a stream's calls as tool-call
deltas.

A stream sends its text as content deltas until the call format's trigger
(``<tool_call>\\n{"name": "`` for Hermes) appears; from there the output is calls, sent as
they are written (tools/stream.py), as OpenAI's deltas: first ``{index, id, type:
"function", function: {name, arguments: ""}}`` once the name is complete, then pieces of its
arguments. A stream cut by max_tokens inside a call ends with that call's arguments
incomplete and finish_reason "length", as OpenAI's do.
"""

from __future__ import annotations

from typing import Any

from ..result import Result
from ..tools.formats import format_for_template
from ..tools.stream import CallDelta, CallStream

__all__ = ["ToolDeltas", "message_of", "tool_kwargs"]


def tool_kwargs(req: Any) -> dict[str, Any]:
    """Engine.chat's tool keywords of a ChatCompletionRequest ({} without tools). The
    deprecated ``functions`` / ``function_call`` are refused (ValueError: a 400)."""
    if req.functions or req.function_call not in (None, "none", "auto"):
        raise ValueError("functions and function_call (deprecated) are not supported: use tools and tool_choice")
    kw: dict[str, Any] = {}
    for name in ("tools", "tool_choice", "parallel_tool_calls"):
        if getattr(req, name) is not None:
            kw[name] = getattr(req, name)
    return kw


def message_of(r: Result) -> dict[str, Any]:
    """OpenAI's assistant message of a Result (tool_calls when it made calls)."""
    if not r.tool_calls:
        return {"role": "assistant", "content": r.text}
    return {"role": "assistant", "content": r.content, "tool_calls": [c.to_openai() for c in r.tool_calls]}


class ToolDeltas:
    """One stream's text deltas -> content deltas and OpenAI's tool-call deltas, as written."""

    def __init__(self, tokenizer: Any) -> None:
        self.calls = CallStream(format_for_template(tokenizer))

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        """(the content to send now, the tool-call deltas to send now)."""
        content, calls = self.calls.feed(delta)
        return content, [_openai_delta(c) for c in calls]

    def finish(self) -> str:
        """The content still held back once the output has ended ("" after calls)."""
        return self.calls.close()


def _openai_delta(c: CallDelta) -> dict[str, Any]:
    if c.id is not None:  # the head: id, type and name, arguments to follow
        return {"index": c.index, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}}
    return {"index": c.index, "function": {"arguments": c.arguments}}
