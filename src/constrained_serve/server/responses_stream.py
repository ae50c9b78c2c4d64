"""The typed event stream of a streamed ``/v1/responses`` request (server/responses.py):
``response.created``, ``response.in_progress``; a message item opened at the first text
(``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta``...), closed by ``.output_text.done``, ``.content_part.done``,
``.output_item.done``; a ``function_call`` item per tool call as the model writes it
(``response.output_item.added``, ``response.function_call_arguments.delta``..., ``.done``,
``response.output_item.done``); then ``response.completed``, ``response.incomplete`` or
``response.failed``. Server-sent events with ``event:`` lines and a ``sequence_number`` each.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from ..result import Result
from ..tools.stream import CallDelta
from .tools import ToolDeltas

__all__ = ["EventStream", "events", "status_of", "text_part"]


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def status_of(result: Result) -> str:
    if result.finish_reason == "abort":
        return "failed"
    return "incomplete" if result.finish_reason == "length" else "completed"


class EventStream:
    """The typed events of one streamed response: a message item opened at the first text,
    a function_call item per call as the model writes it (server/responses_tools.py)."""

    def __init__(self, b: Any) -> None:
        self.b = b
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # the output items, as they stand
        self.text: str | None = None  # the open message item's text (None: none open)

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.b.item_id, "output_index": 0, "content_index": 0}

    def text_delta(self, delta: str) -> list[str]:
        out = []
        if self.text is None:
            self.text = ""
            self.items.append(self.b.message(None, "in_progress"))
            out.append(self.event("response.output_item.added", output_index=0, item=self.items[0]))
            out.append(self.event("response.content_part.added", **self._where(), part=text_part("")))
        self.text += delta
        out.append(self.event("response.output_text.delta", **self._where(), delta=delta, logprobs=[]))
        return out

    def close_text(self, status: str) -> list[str]:
        if self.text is None or self.items[0]["status"] != "in_progress":
            return []
        item = self.items[0] = self.b.message(self.text, status)
        return [
            self.event("response.output_text.done", **self._where(), text=self.text, logprobs=[]),
            self.event("response.content_part.done", **self._where(), part=text_part(self.text)),
            self.event("response.output_item.done", output_index=0, item=item),
        ]

    def call_delta(self, c: CallDelta) -> list[str]:
        if c.id is not None:
            out = self.close_text("completed")
            item = {
                "id": "fc_" + c.id.removeprefix("call_"),
                "type": "function_call",
                "call_id": c.id,
                "name": c.name,
                "arguments": "",
                "status": "in_progress",
            }
            self.items.append(item)
            return [*out, self.event("response.output_item.added", output_index=len(self.items) - 1, item=item)]
        item, index = self.items[-1], len(self.items) - 1
        item["arguments"] += c.arguments
        out = []
        if c.arguments:
            out.append(
                self.event(
                    "response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=c.arguments
                )
            )
        if c.done:
            item["status"] = "completed"
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=item["arguments"],
                )
            )
            out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out

    def finish(self, result: Result, status: str) -> list[str]:
        item_status = "incomplete" if status == "incomplete" else "completed"
        out = []
        if not self.items:  # no text and no call: an empty message, as the response has
            out += self.text_delta("")[:2]
        out += self.close_text(item_status)
        for index, item in enumerate(self.items):
            if item["type"] == "function_call" and item["status"] == "in_progress":  # cut inside the call
                item["status"] = "incomplete"
                out.append(self.event("response.output_item.done", output_index=index, item=item))
        response = self.b.response(status, result)
        response["output"] = self.items
        out.append(self.event(f"response.{status}", response=response))
        return out


async def events(b: Any, stream: Any, tools: ToolDeltas | None) -> AsyncIterator[str]:
    events = EventStream(b)
    yield events.event("response.created", response=b.response("in_progress"))
    yield events.event("response.in_progress", response=b.response("in_progress"))
    async for delta, result in stream.events():
        if result is None:
            calls: list[CallDelta] = []
            if tools is not None:
                delta, calls = tools.calls.feed(delta)
            for e in events.text_delta(delta) if delta else []:
                yield e
            for c in calls:
                for e in events.call_delta(c):
                    yield e
            continue
        status = status_of(result)
        if status == "failed":
            yield events.event("response.failed", response=b.response("failed", result))
            return
        rest = tools.finish() if tools is not None else ""
        for e in events.text_delta(rest) if rest else []:
            yield e
        for e in events.finish(result, status):
            yield e
