"""A finished tool-calling output -> ``Result.tool_calls``. The grammar (grammar.py) fixed the
format, so reading it is exact: the text before the format's trigger is content, then calls
as ``start {"name": ..., "<args_key>": {...}} end``, joined by the separator. Each call's
arguments are validated against its function's parameters schema once more (jsonschema,
patterns read as ECMA-262): an output that does not is reported, never passed as valid.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from typing import Any

from ..errors import OutputValidationError
from ..result import ToolCall
from .formats import CallFormat

__all__ = ["new_call_id", "parse_tool_calls"]


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def split_calls(text: str, fmt: CallFormat) -> tuple[str, list[dict[str, Any]]]:
    """``(content, call objects)`` of an output written in ``fmt``; ValueError where the text
    is not in that format (the grammar did not hold)."""
    at = text.find(fmt.trigger)
    if at < 0:
        return text, []
    decoder = json.JSONDecoder()
    calls, pos = [], at
    while True:
        if not text.startswith(fmt.start, pos):
            raise ValueError(f"expected {fmt.start!r} at offset {pos}")
        obj, pos = decoder.raw_decode(text, pos + len(fmt.start))
        if not isinstance(obj, dict) or set(obj) != {"name", fmt.args_key}:
            raise ValueError(f"a call must be {{'name': ..., {fmt.args_key!r}: ...}}, got {obj!r}")
        if not text.startswith(fmt.end, pos):
            raise ValueError(f"expected {fmt.end!r} at offset {pos}")
        calls.append(obj)
        pos += len(fmt.end)
        if pos == len(text):
            return text[:at], calls
        if not text.startswith(fmt.separator, pos):
            raise ValueError(f"unexpected text after a call at offset {pos}: {text[pos : pos + 40]!r}")
        pos += len(fmt.separator)


def parse_tool_calls(
    text: str, fmt: CallFormat, parameters: Mapping[str, dict[str, Any]]
) -> tuple[str | None, list[ToolCall]]:
    """``(content, calls)``: content None when empty. ``parameters``: the callable
    functions' schemas by name. Raises ValueError (OutputValidationError for arguments
    that do not validate) naming the call."""
    from ..grammar.output_check import _schema_validator
    from ..grammar.spec import canonical_json

    content, objs = split_calls(text, fmt)
    calls = []
    for i, obj in enumerate(objs):
        name, args = obj["name"], obj[fmt.args_key]
        if name not in parameters:
            raise ValueError(f"tool call {i} names an unknown function {name!r}")
        if not isinstance(args, dict):
            raise OutputValidationError(f"tool call {i} ({name}): arguments are not a JSON object", args)
        validator = _schema_validator(canonical_json(parameters[name]))
        error = next(iter(validator.iter_errors(args)), None) if validator is not None else None
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path) or "the top level"
            raise OutputValidationError(
                f"tool call {i} ({name}): the arguments do not validate against the parameters schema at "
                f"{where}: {error.message}; nothing was repaired",
                args,
            )
        calls.append(ToolCall(new_call_id(), name, args, json.dumps(args, ensure_ascii=False)))
    return (content or None), calls
