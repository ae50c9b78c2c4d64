"""GBNF character escapes, spelled so that both backends read them as llama.cpp does.

In llama.cpp's GBNF, ``\\xHH``, ``\\uHHHH`` and ``\\UHHHHHHHH`` take exactly 2, 4 and 8 hex
digits. llguidance (1.9) refuses ``\\u``/``\\U`` in GBNF, and xgrammar (0.2.9) reads ``\\x``
greedily: ``"\\x41B"`` became U+041B instead of "AB". Inside string literals and character
classes we therefore write such an escape as the character itself, or, for characters
with a meaning there (quote, brackets, backslash, ``-`` and ``^`` in a class, control
characters), as the short escape both backends read the same way.
"""
from __future__ import annotations

import re

__all__ = ["normalize_gbnf_escapes"]

_ESCAPE = re.compile(r"\\(?:x([0-9A-Fa-f]{2})|u([0-9A-Fa-f]{4})|U([0-9A-Fa-f]{8}))")
_SHORT = {"\t": "\\t", "\n": "\\n", "\r": "\\r", '"': '\\"', "\\": "\\\\", "[": "\\[", "]": "\\]"}


def normalize_gbnf_escapes(text: str) -> str:
    out: list[str] = []
    i, n = 0, len(text)
    context = None  # None (rules), '"' (in a string literal) or "[" (in a character class)
    while i < n:
        ch = text[i]
        if context is None:
            if ch == "#":  # a comment runs to the end of the line
                end = text.find("\n", i)
                end = n if end < 0 else end
                out.append(text[i:end])
                i = end
                continue
            if ch in '"[':
                context = ch
            out.append(ch)
            i += 1
            continue
        if ch == "\\":
            m = _ESCAPE.match(text, i)
            if m is not None:
                out.append(_spell(chr(int(next(g for g in m.groups() if g), 16)), context))
                i = m.end()
            else:
                out.append(text[i:i + 2])  # \n, \", \\, \] ...: both backends read these alike
                i += 2
            continue
        if (context == '"' and ch == '"') or (context == "[" and ch == "]"):
            context = None
        out.append(ch)
        i += 1
    return "".join(out)


def _spell(c: str, context: str) -> str:
    if c in _SHORT:
        return _SHORT[c]
    if ord(c) < 0x20 or ord(c) == 0x7F or (context == "[" and c in "-^"):
        return f"\\x{ord(c):02X}"  # nothing printable: a hex escape (which no hex digit follows in practice)
    return c
