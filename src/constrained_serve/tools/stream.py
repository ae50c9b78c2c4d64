"""A tool-calling output read as it streams: its text deltas -> content (sent at once) and
calls (sent as they are written: the name once it is complete, then the arguments piece by
piece), for the servers' streamed responses (server/tools.py, server/responses.py).

The grammar (grammar.py) fixes the format, so reading a prefix is exact: content until the
format's trigger, then per call ``start {"name": "<name>", "<args_key>": `` (the head), the
arguments object (its end found by counting brackets outside strings), ``}`` and the end
marker, then the separator and the next call. A piece of content that may be the start of
the trigger is held back until the next delta tells.

The streamed arguments are the text the model wrote, so their concatenation parses to the
arguments of the finished ``Result.tool_calls`` (spelled the same way: the grammar allows
one spelling, json.dumps'). A stream cut by max_tokens inside a call ends with that call's
arguments incomplete, as OpenAI's streams do (finish_reason "length").
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .formats import CallFormat
from .parse import new_call_id

__all__ = ["CallDelta", "CallStream"]


@dataclass
class CallDelta:
    """A piece of call ``index``: its head (``id`` and ``name`` set, ``arguments`` "") or
    more of its arguments' text (``id`` and ``name`` None); ``done``: its arguments ended."""

    index: int
    id: str | None
    name: str | None
    arguments: str
    done: bool = False


class CallStream:
    """One output's deltas -> (content, call deltas); feed every delta, in order."""

    def __init__(self, fmt: CallFormat) -> None:
        self.fmt = fmt
        self._head = re.compile(
            re.escape(fmt.start) + r'\{"name": "([A-Za-z0-9_.:-]*)", ' + re.escape(json.dumps(fmt.args_key)) + ": "
        )
        self._tail = "}" + fmt.end
        self._text = ""  # content not sent yet, then (from the trigger on) the calls
        self._pos = 0  # where reading the calls has got to in _text
        self._state = "content"  # content -> head -> args -> tail -> between -> head ...
        self._depth = 0
        self._in_string = self._escaped = False
        self.calls: list[CallDelta] = []  # each call's head, arguments joined as streamed so far

    @property
    def in_calls(self) -> bool:
        return self._state != "content"

    def feed(self, delta: str) -> tuple[str, list[CallDelta]]:
        self._text += delta
        content = ""
        if self._state == "content":
            content = self._content()
        return content, self._read_calls() if self._state != "content" else []

    def close(self) -> str:
        """The held-back content once the output ended without a call ("" after a call)."""
        if self._state != "content":
            return ""
        held, self._text = self._text, ""
        return held

    def _content(self) -> str:
        trigger = self.fmt.trigger
        at = self._text.find(trigger)
        if at >= 0:
            out, self._text, self._state = self._text[:at], self._text[at:], "head"
            return out
        keep = next(
            (k for k in range(min(len(trigger) - 1, len(self._text)), 0, -1) if self._text.endswith(trigger[:k])), 0
        )
        cut = len(self._text) - keep
        out, self._text = self._text[:cut], self._text[cut:]
        return out

    def _read_calls(self) -> list[CallDelta]:
        out: list[CallDelta] = []
        text = self._text
        while True:
            if self._state == "head":
                m = self._head.match(text, self._pos)
                if m is None:
                    return out
                call = CallDelta(len(self.calls), new_call_id(), m.group(1), "")
                self.calls.append(call)
                out.append(CallDelta(call.index, call.id, call.name, ""))
                self._pos, self._state, self._depth = m.end(), "args", 0
            elif self._state == "args":
                start, end = self._pos, self._scan_arguments(text)
                piece = text[start:end]
                self._pos = end
                done = self._state == "tail"
                if piece or done:
                    call = self.calls[-1]
                    call.arguments += piece
                    call.done = done
                    out.append(CallDelta(call.index, None, None, piece, done))
                if not done:
                    return out
            elif self._state == "tail":
                if len(text) < self._pos + len(self._tail):
                    return out
                self._pos += len(self._tail)
                self._state = "between"
            else:  # between: the separator and the next call, or the end of the output
                sep = self.fmt.separator
                if len(text) < self._pos + len(sep):
                    return out
                self._pos += len(sep)
                self._state = "head"

    def _scan_arguments(self, text: str) -> int:
        """Read the arguments object from ``self._pos`` on; the offset read up to (past its
        closing bracket once it has one: then the state is "tail")."""
        for i in range(self._pos, len(text)):
            ch = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._state = "tail"
                    return i + 1
        return len(text)
