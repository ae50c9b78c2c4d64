"""``\\d`` and ``\\w`` as ASCII classes, before a pattern reaches a backend.

llguidance reads a regex with Rust's ``regex`` syntax, where ``\\d`` is any Unicode decimal
digit (U+1FBF8 "🯸" among them) and ``\\w`` any Unicode word character. A JSON Schema
``pattern`` means ECMA-262, where ``\\d`` is ``[0-9]`` and ``\\w`` is ``[A-Za-z0-9_]``; users
of Outlines and xgrammar expect the same of ``regex=``. So both are rewritten here:

- ``\\d`` -> ``[0-9]``, ``\\w`` -> ``[0-9A-Za-z_]``, ``\\D`` / ``\\W`` -> their negations;
- inside a class, ``\\d`` and ``\\w`` become their ranges (``[\\d.]`` -> ``[0-9.]``); a class
  holding ``\\D`` or ``\\W`` becomes the one flat class it means (``[a\\D]`` -> ``[^0-9]``,
  ``[^a\\W]`` -> ``[0-9A-Z_b-z]``), so that the backends and Python's ``re`` (the final output
  check) read it alike; only a class already in Rust-only syntax keeps a nested class.

Under a case-insensitive flag (``(?i)``, ``(?i:...)``), a flat class leaves out both cases of
the letters the class names (``(?i)[^a\\W]`` -> ``[0-9B-Z_b-z]``, never ``A``), since the
flag folds the flat class too. The flag is read for the whole pattern: a class outside the
flag's group is flattened the same way (a pattern mixing both is rare).

``\\s`` is left as it is (Unicode whitespace in ECMA-262 too). ``regex=`` with
``unicode_classes=True`` keeps the backend's Unicode meaning; ``\\p{Nd}`` / ``\\p{L}`` ask for
Unicode classes explicitly in any case.
"""

from __future__ import annotations

import re
from typing import Any

from .regex_scan import class_end, escape_end, regex_tokens

__all__ = ["ascii_classes", "ascii_schema_patterns"]

_FLAT = {"d": "0-9", "w": "0-9A-Za-z_"}
_OUTSIDE = {"\\d": "[0-9]", "\\w": "[0-9A-Za-z_]", "\\D": "[^0-9]", "\\W": "[^0-9A-Za-z_]"}


_DIGITS = "0123456789"
_SETS = {"D": frozenset(_DIGITS), "W": frozenset(_DIGITS + "ABCDEFGHIJKLMNOPQRSTUVWXYZ_abcdefghijklmnopqrstuvwxyz")}


def _class(token: str, fold: bool = False) -> str:
    if not token.endswith("]"):
        return token  # an unterminated class: the backend reports it
    j, end = 1, len(token) - 1
    negated = token.startswith("^", j)
    j += negated
    items: list[str] = []  # the class's other items, \d and \w as ranges
    complements: list[str] = []  # the \D and \W in it
    nested = False
    if token.startswith("]", j):
        items.append("\\]")
        j += 1
    while j < end:
        if token[j] == "\\":
            k = escape_end(token, j)
            esc = token[j:k]
            if esc[1:] in _FLAT:
                items.append(_FLAT[esc[1:]])
            elif esc[1:] in _SETS:
                complements.append(esc[1:])
            else:
                items.append(esc)
            j = k
        elif token[j] == "[":  # a nested class (Rust syntax): rewrite it too
            k = class_end(token, j)
            items.append(_class(token[j:k], fold))
            nested = True
            j = k
        else:
            items.append(token[j])
            j += 1
    if not complements:
        return "[" + "^" * negated + "".join(items) + "]"
    flat = _resolve(items, complements, negated, fold) if not nested else None
    if flat is not None:
        return flat
    # Rust's class union, which only the backends read (the class had Rust syntax already).
    return "[" + "^" * negated + "".join(items) + "".join(_OUTSIDE["\\" + c] for c in complements) + "]"


def _resolve(items: list[str], complements: list[str], negated: bool, fold: bool) -> str | None:
    """A class holding \\D or \\W as one flat class that every dialect reads alike: the class
    [X\\D] is everything but the digits X lacks, [^X\\D] the digits X lacks (and so for \\W and
    its 63 ASCII word characters). ``fold``: X read case-insensitively. None where Python
    cannot read X (Rust-only syntax)."""
    import warnings

    body = "".join(items)
    left = frozenset.intersection(*(_SETS[c] for c in complements))
    if body:
        if body.startswith("^"):
            body = "\\" + body
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", FutureWarning)  # a POSIX class or set operation
                x = re.compile("[" + body + "]", re.IGNORECASE if fold else 0)
        except (re.error, FutureWarning):
            return None
        left = frozenset(c for c in left if not x.fullmatch(c))
    if not left:  # every digit (word character) in X: [X\\D] is anything, [^X\\D] nothing
        return None if negated else r"[\s\S]"
    return "[" + ("" if negated else "^") + _ranges(sorted(left)) + "]"


def _ranges(chars: list[str]) -> str:
    out, i = [], 0
    while i < len(chars):
        k = i
        while k + 1 < len(chars) and ord(chars[k + 1]) == ord(chars[k]) + 1:
            k += 1
        out.append(chars[i] if k == i else chars[i] + ("" if k == i + 1 else "-") + chars[k])
        i = k + 1
    return "".join(out)


# An inline flag group that turns case-insensitivity on: (?i), (?mi), (?i:...), (?i-s:...).
_CASE_FLAG = re.compile(r"\(\?[a-zA-Z]*i[a-zA-Z]*(?:-[a-zA-Z]*)?[:)]")


def ascii_classes(pattern: str) -> str:
    """``pattern`` with ``\\d``, ``\\w``, ``\\D``, ``\\W`` as ASCII classes (see module docstring)."""
    if "\\" not in pattern:
        return pattern
    fold = _CASE_FLAG.search(pattern) is not None
    out = []
    for t in regex_tokens(pattern):
        if t in _OUTSIDE:
            out.append(_OUTSIDE[t])
        elif t.startswith("[") and "\\" in t:
            out.append(_class(t, fold))
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
