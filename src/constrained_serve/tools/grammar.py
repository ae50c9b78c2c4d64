"""The Lark grammar (llguidance) of a tool_choice: each call's arguments are an embedded
``%json{...}`` of its function's parameters schema, so a call the grammar lets through
parses and matches its function.

- ``"required"`` (or one named function): one call, or with ``parallel_tool_calls`` one or
  more joined by the format's separator; nothing else.
- ``"auto"``: free text OR calls, in one grammar. Free text (``TEXT``) never contains the
  format's marker (``<tool_call>`` for Hermes); the first time the model writes it, after
  any text or none (``lead``), the output turns into calls and must go on as one: the rest
  of the trigger (``\\n{"name": "``), a known name, arguments that match its schema, the end
  marker. The model decides at every token, and whichever way it goes the output parses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..grammar.lark_parts import json_embed, lark_literal
from .formats import CallFormat

__all__ = ["JSON_STYLE", "tool_grammar"]

# How the arguments JSON is spelled: json.dumps' default separators and no free whitespace,
# the way chat models were trained to write tool calls (and one way only: fewer tokens to choose).
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


_lit = lark_literal


def _json(schema: dict[str, Any]) -> str:
    return json_embed(schema, JSON_STYLE)


def tool_grammar(functions: Sequence[tuple[str, dict[str, Any]]], fmt: CallFormat, mode: str, parallel: bool) -> str:
    """The grammar for ``functions`` ((name, parameters schema) pairs, the ones that may be
    called) written in ``fmt``: ``mode`` "auto" (text or calls) or "required" (calls only)."""
    if mode not in ("auto", "required"):
        raise ValueError(f"tool grammar mode must be 'auto' or 'required', got {mode!r}")
    if not functions:
        raise ValueError("a tool grammar needs at least one function")
    lines = [f"TRIGGER: {_lit(fmt.trigger)}", f"SEP: {_lit(fmt.separator)} TRIGGER"]
    more = " (SEP rest)*" if parallel else ""
    if mode == "auto":
        lines += [
            f"start: PLAIN | lead rest{more}",
            f"MARKER: {_lit(fmt.marker)}",
            "TEXT: /(?s:.*)/ & ~(/(?s:.*)/ MARKER /(?s:.*)/)",
            "PLAIN: /(?s:.+)/ & TEXT",
            "lead[lazy]: TEXT TRIGGER",
        ]
    else:
        lines.append(f"start: TRIGGER rest{more}")
    lines.append("rest: " + " | ".join(f"rest_{i}" for i in range(len(functions))))
    for i, (name, parameters) in enumerate(functions):
        rest = fmt.head(name)[len(fmt.trigger) :]  # name", "arguments":  (the trigger wrote the opening quote)
        lines.append(f"rest_{i}: {_lit(rest)} args_{i} {_lit('}' + fmt.end)}")
        lines.append(f"args_{i}: {_json(parameters)}")
    return "\n".join(lines) + "\n"
