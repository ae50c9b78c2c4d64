"""Tool calling on the wire (OpenAI's chat completions): the request's ``tools``,
``tool_choice`` and ``parallel_tool_calls`` as ``Engine.chat``'s keywords, a Result's calls as
``message.tool_calls`` with ``finish_reason: "tool_calls"``, and a stream's calls as tool-call
deltas.

A stream sends its text as content deltas until the call format's trigger
(``<tool_call>\\n{"name": "`` for Hermes) appears; from there the output is calls, which are
sent when it ends, each as OpenAI's deltas: first ``{index, id, type: "function", function:
{name, arguments: ""}}``, then its arguments. A piece of text that may be the start of the
trigger is held back until the next delta tells. A stream whose calls did not complete (cut
by max_tokens) sends the held-back text as content, as the non-streamed response does.
"""

from __future__ import annotations

from typing import Any

from ..result import Result
from ..tools.formats import format_for_template

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
    """One stream's text deltas split into content (sent at once) and calls (sent at the end)."""

    def __init__(self, tokenizer: Any) -> None:
        self.trigger = format_for_template(tokenizer).trigger
        self._held = ""  # text not sent yet: a possible start of the trigger, or the calls
        self._in_calls = False

    def content(self, delta: str) -> str:
        """What of ``delta`` to send as content now."""
        self._held += delta
        if self._in_calls:
            return ""
        at = self._held.find(self.trigger)
        if at >= 0:
            out, self._held, self._in_calls = self._held[:at], self._held[at:], True
            return out
        keep = next(
            (
                k
                for k in range(min(len(self.trigger) - 1, len(self._held)), 0, -1)
                if self._held.endswith(self.trigger[:k])
            ),
            0,
        )
        out, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
        return out

    def finish(self, r: Result) -> tuple[str, list[dict[str, Any]]]:
        """(the content still to send, the tool-call deltas) once the output has ended."""
        if not r.tool_calls:
            held, self._held = self._held, ""
            return held, []
        deltas: list[dict[str, Any]] = []
        for i, c in enumerate(r.tool_calls):
            deltas.append({"index": i, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}})
            deltas.append({"index": i, "function": {"arguments": c.arguments_json}})
        return "", deltas
