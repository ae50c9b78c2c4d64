"""Pieces of the Lark grammars we write for llguidance around JSON Schemas: string literals
and embedded ``%json{...}`` schemas, each with the JSON style it is written in. Used by the
tool-call grammar (tools/grammar.py) and the grounded-fields grammar (grounded_lark.py), so
both embed schemas the same way."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["lark_literal", "json_embed", "json_style"]


def lark_literal(text: str) -> str:
    """A Lark string literal of ``text`` (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def json_style(whitespace: bool, item_separator: str = ",", key_separator: str = ":", strict: bool = True) -> dict:
    """llguidance's ``x-guidance`` options: free whitespace or exactly these separators, and
    (``strict=False``) the lenient reading of unsupported keywords."""
    style: dict[str, Any] = {"whitespace_flexible": whitespace}
    if not whitespace:
        style.update(item_separator=item_separator, key_separator=key_separator)
    if not strict:
        style.update(lenient=True, coerce_one_of=True)
    return style


def json_embed(schema: dict[str, Any], style: dict[str, Any]) -> str:
    """``%json {...}``: the schema as a Lark non-terminal, written in ``style``."""
    return "%json " + json.dumps({**schema, "x-guidance": style}, ensure_ascii=False)
