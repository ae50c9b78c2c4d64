"""Where each value of a JSON text lies, and which values are complete, for a text that may be
cut anywhere (an output still streaming).

``scan(text)`` walks the text once and returns a ``Span`` per value (path, character range,
complete or not) and the value of everything complete so far: a complete member of an object
or array is in it, an unfinished one is not (a number at the very end may still grow, so it
is complete only once something follows it). Field confidences (outputs.py) and partial
objects while streaming (partial.py) are built on it.

Paths are JSONPath: ``$``, ``$.name``, ``$.items[0]``, ``$["a key"]``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Span", "scan"]

_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_HEAD = re.compile(r"-?(?:0|[1-9][0-9]*)?(?:\.[0-9]*)?(?:[eE][+-]?[0-9]*)?")  # a number cut anywhere
_WS = " \t\n\r"
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_INCOMPLETE = object()


@dataclass(frozen=True)
class Span:
    path: str
    start: int
    end: int  # exclusive; the end of the text for an unfinished value
    complete: bool


def child_path(parent: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if _IDENT.match(key) else f"{parent}[{json.dumps(key, ensure_ascii=False)}]"


class _Scanner:
    def __init__(self, text: str) -> None:
        self.s = text
        self.spans: list[Span] = []

    def ws(self, i: int) -> int:
        while i < len(self.s) and self.s[i] in _WS:
            i += 1
        return i

    def value(self, i: int, path: str) -> tuple[Any, int]:
        """(the value, or _INCOMPLETE; the index after it)."""
        s = self.s
        i = self.ws(i)
        if i >= len(s):
            return _INCOMPLETE, i
        ch = s[i]
        if ch == "{":
            return self.container(i, path, "}", self.member)
        if ch == "[":
            return self.container(i, path, "]", self.item)
        if ch == '"':
            value, end = self.string(i)
        elif ch in "-0123456789":
            if _NUMBER_HEAD.fullmatch(s, i):  # runs to the end: "3" may still become "31", "2." "2.5"
                value, end = _INCOMPLETE, len(s)
            else:
                m = _NUMBER.match(s, i)
                if m is None:
                    raise ValueError(f"not JSON at character {i}: {s[i : i + 20]!r}")
                value, end = json.loads(m.group()), m.end()
        else:
            for word, v in (("true", True), ("false", False), ("null", None)):
                if s.startswith(word, i):
                    value, end = v, i + len(word)
                    break
            else:
                end = len(s) if any(w.startswith(s[i:]) for w in ("true", "false", "null")) else i
                value = _INCOMPLETE
                if end == i:
                    raise ValueError(f"not JSON at character {i}: {s[i : i + 20]!r}")
        self.spans.append(Span(path, i, end, value is not _INCOMPLETE))
        return value, end

    def string(self, i: int) -> tuple[Any, int]:
        try:
            value, end = json.decoder.scanstring(self.s, i + 1)
            return value, end
        except json.JSONDecodeError:
            return _INCOMPLETE, len(self.s)

    def container(
        self, i: int, path: str, close: str, part: Callable[[int, str, int, Any], tuple[bool, int]]
    ) -> tuple[Any, int]:
        out: Any = {} if close == "}" else []
        start, j, index = i, self.ws(i + 1), 0
        at = len(self.spans)
        self.spans.append(Span(path, start, len(self.s), False))  # replaced once closed
        if j < len(self.s) and self.s[j] == close:
            self.spans[at] = Span(path, start, j + 1, True)
            return out, j + 1
        while True:
            ok, j = part(j, path, index, out)
            index += 1
            j = self.ws(j)
            if not ok or j >= len(self.s):
                return _partial(out), len(self.s)
            if self.s[j] == ",":
                j += 1
                continue
            if self.s[j] == close:
                self.spans[at] = Span(path, start, j + 1, True)
                return out, j + 1
            raise ValueError(f"not JSON at character {j}: {self.s[j : j + 20]!r}")

    def member(self, j: int, path: str, index: int, out: dict) -> tuple[bool, int]:
        j = self.ws(j)
        if j >= len(self.s):
            return False, j
        if self.s[j] != '"':
            raise ValueError(f"not JSON at character {j}: expected a key")
        key, j = self.string(j)
        j = self.ws(j)
        if key is _INCOMPLETE or j >= len(self.s):
            return False, j
        if self.s[j] != ":":
            raise ValueError(f"not JSON at character {j}: expected ':'")
        value, j = self.value(j + 1, child_path(path, key))
        if isinstance(value, _Partial):
            out[key] = value
            return False, j
        if value is _INCOMPLETE:
            return False, j
        out[key] = value
        return True, j

    def item(self, j: int, path: str, index: int, out: list) -> tuple[bool, int]:
        value, j = self.value(j, child_path(path, index))
        if value is _INCOMPLETE:
            return False, j
        out.append(value)
        return not isinstance(value, _Partial), j


class _Partial:
    """An unfinished container: what of it is complete so far."""

    def __init__(self, value: Any) -> None:
        self.value = value


def _partial(value: Any) -> _Partial:
    return _Partial(value)


def _strip(value: Any) -> Any:
    """The plain value, unfinished containers unwrapped."""
    if isinstance(value, _Partial):
        value = value.value
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def scan(text: str) -> tuple[list[Span], Any, bool]:
    """(every value's Span in order of start, the value of what is complete, whether the
    whole text is one complete value). ValueError where the text is not (a prefix of) JSON."""
    sc = _Scanner(text)
    value, end = sc.value(0, "$")
    complete = value is not _INCOMPLETE and not isinstance(value, _Partial) and sc.ws(end) == len(text)
    if value is _INCOMPLETE:
        value = None
    return sc.spans, _strip(value), complete


def complete_members(text: str) -> dict[str, Any] | None:
    """The members of a (maybe cut) JSON object whose values are complete, by key; None if the
    text does not start an object."""
    if not text.lstrip().startswith("{"):
        return None
    sc = _Scanner(text)
    value, _ = sc.value(0, "$")
    raw = value.value if isinstance(value, _Partial) else value
    if not isinstance(raw, dict):
        return None
    return {k: v for k, v in raw.items() if not isinstance(v, _Partial)}
