"""GBNF character escapes, spelled for each backend so that it reads them as llama.cpp does.

In llama.cpp's GBNF, ``\\xHH``, ``\\uHHHH`` and ``\\UHHHHHHHH`` take exactly 2, 4 and 8 hex
digits. The backends (llguidance 1.9, xgrammar 0.2.9) each read one form differently:
llguidance refuses ``\\u``/``\\U``; xgrammar reads ``\\x`` greedily (``"\\x41B"`` became U+041B
instead of "AB") but ``\\u``/``\\U`` exactly. So, inside string literals and character classes:
for llguidance, ``\\u``/``\\U`` become the character itself, or ``\\xHH`` where the character
means something there (quote, bracket, backslash, ``-``/``^`` in a class, control characters;
all below 0x80); for xgrammar, ``\\xHH`` becomes ``\\u00HH``.
"""

from __future__ import annotations

import re

from ..errors import GrammarError

__all__ = ["gbnf_for_backend"]

_ESCAPE = re.compile(r"\\(?:x([0-9A-Fa-f]{2})|u([0-9A-Fa-f]{4})|U([0-9A-Fa-f]{8}))")
_MEANINGFUL = {'"': '"\\[]', "[": '"\\[]-^'}  # characters with a role in a string / a class


def gbnf_for_backend(text: str, backend: str) -> str:
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
                out.append(_spell(_code_point(m), context, backend))
                i = m.end()
            else:
                out.append(text[i : i + 2])  # \n, \", \\, \] ...: both backends read these alike
                i += 2
            continue
        if (context == '"' and ch == '"') or (context == "[" and ch == "]"):
            context = None
        out.append(ch)
        i += 1
    return "".join(out)


def _code_point(m: re.Match) -> int:
    code = int(next(g for g in m.groups() if g), 16)
    if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
        raise GrammarError(f"GBNF escape {m.group(0)} is not a Unicode character", reason="bad escape")
    return code


def _spell(code: int, context: str, backend: str) -> str:
    if backend == "xgrammar":
        return f"\\u{code:04X}" if code <= 0xFFFF else f"\\U{code:08X}"
    c = chr(code)
    if code < 0x20 or code == 0x7F or c in _MEANINGFUL[context]:
        return f"\\x{code:02X}"  # llguidance reads \x as exactly two digits
    return c
