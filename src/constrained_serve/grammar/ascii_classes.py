"""``\\d`` and ``\\w`` as ASCII classes, before a pattern reaches a backend.

llguidance reads a regex with Rust's ``regex`` syntax, where ``\\d`` is any Unicode decimal
digit (U+1FBF8 "🯸" among them) and ``\\w`` any Unicode word character. A JSON Schema
``pattern`` means ECMA-262, where ``\\d`` is ``[0-9]`` and ``\\w`` is ``[A-Za-z0-9_]``; users
of Outlines and xgrammar expect the same of ``regex=``. So both are rewritten here:

- ``\\d`` -> ``[0-9]``, ``\\w`` -> ``[0-9A-Za-z_]``, ``\\D`` / ``\\W`` -> their negations;
- inside a class, ``\\d`` and ``\\w`` become their ranges (``[\\d.]`` -> ``[0-9.]``); a
  ``\\D`` or ``\\W`` inside a class (no flat rewrite) becomes a nested class, which the
  backends' Rust syntax reads.

``\\s`` is left as it is (Unicode whitespace in ECMA-262 too). ``regex=`` with
``unicode_classes=True`` keeps the backend's Unicode meaning; ``\\p{Nd}`` / ``\\p{L}`` ask for
Unicode classes explicitly in any case.
"""

from __future__ import annotations

from typing import Any

from .regex_scan import class_end, escape_end, regex_tokens

__all__ = ["ascii_classes", "ascii_schema_patterns"]

_FLAT = {"d": "0-9", "w": "0-9A-Za-z_"}
_OUTSIDE = {"\\d": "[0-9]", "\\w": "[0-9A-Za-z_]", "\\D": "[^0-9]", "\\W": "[^0-9A-Za-z_]"}


def _class(token: str) -> str:
    out, j, end = ["["], 1, len(token) - 1
    if not token.endswith("]"):
        return token  # an unterminated class: the backend reports it
    if token.startswith("^", j):
        out.append("^")
        j += 1
    if token.startswith("]", j):
        out.append("]")
        j += 1
    while j < end:
        if token[j] == "\\":
            k = escape_end(token, j)
            esc = token[j:k]
            if esc[1:] in _FLAT:
                out.append(_FLAT[esc[1:]])
            elif esc[1:] in ("D", "W"):
                out.append(_OUTSIDE[esc])
            else:
                out.append(esc)
            j = k
        elif token[j] == "[":  # a nested class (Rust syntax): rewrite it too
            k = class_end(token, j)
            out.append(_class(token[j:k]))
            j = k
        else:
            out.append(token[j])
            j += 1
    out.append("]")
    return "".join(out)


def ascii_classes(pattern: str) -> str:
    """``pattern`` with ``\\d``, ``\\w``, ``\\D``, ``\\W`` as ASCII classes (see module docstring)."""
    if "\\" not in pattern:
        return pattern
    out = []
    for t in regex_tokens(pattern):
        if t in _OUTSIDE:
            out.append(_OUTSIDE[t])
        elif t.startswith("[") and "\\" in t:
            out.append(_class(t))
        else:
            out.append(t)
    return "".join(out)


_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
_NAME_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def ascii_schema_patterns(schema: Any) -> Any:
    """A copy of ``schema`` with every ``pattern`` and ``patternProperties`` key read as
    ECMA-262 does (ASCII ``\\d`` and ``\\w``). Iterative: no recursion limit to hit."""
    root: list[Any] = [None]
    # (container to write into, key there, the value, whether the value is a name map)
    stack: list[tuple[Any, Any, Any, bool]] = [(root, 0, schema, False)]
    while stack:
        parent, key, node, name_map = stack.pop()
        if isinstance(node, dict):
            new: dict[Any, Any] = {}
            parent[key] = new
            for k, v in node.items():
                if name_map:
                    k2 = ascii_classes(k) if key == "patternProperties" and isinstance(k, str) else k
                    new[k2] = None  # the key's place, in order
                    stack.append((new, k2, v, False))
                elif k == "pattern" and isinstance(v, str):
                    new[k] = ascii_classes(v)
                elif k in _DATA_KEYWORDS:
                    new[k] = v
                else:
                    new[k] = None
                    stack.append((new, k, v, k in _NAME_MAPS and isinstance(v, dict)))
        elif isinstance(node, list):
            new_list: list[Any] = [None] * len(node)
            parent[key] = new_list
            for i, v in enumerate(node):
                stack.append((new_list, i, v, False))
        else:
            parent[key] = node
    return root[0]
