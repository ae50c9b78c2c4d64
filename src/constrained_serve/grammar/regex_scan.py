"""A Python regex cut into its pieces, for the code that rewrites patterns for another
engine (regex_check.py for the ``regex`` package, xgrammar_gaps.py for xgrammar).

A piece is an escape (``\\d``, ``\\N{NAME}``), a whole character class (``[^\\]a-z]``), a
group opening (``(``, ``(?:``, ``(?P<name>``, inline flags ``(?i)`` / ``(?s-m:``), a comment
(``(?#...)``), a counted quantifier (``{2,5}``), or one other character. Joined, the pieces
are the pattern again. The pattern is assumed to compile under ``re``.
"""

from __future__ import annotations

import re

__all__ = ["QUANTIFIER", "class_end", "escape_end", "regex_tokens"]

# re's quantifier syntax: {m}, {m,}, {,n}, {m,n}; any other "{" is a literal to re.
QUANTIFIER = re.compile(r"\{(?:\d+(?:,\d*)?|,\d*)\}")
_GROUP_OPENING = re.compile(r"\((?:\?(?::|P?<[A-Za-z_]\w*>|[a-zA-Z]*(?:-[a-zA-Z]*)?[:)]))?")


def escape_end(pattern: str, i: int) -> int:
    """End of the escape at ``pattern[i] == "\\\\"``; ``\\N{NAME}`` runs to its brace."""
    if pattern.startswith("N{", i + 1):
        close = pattern.find("}", i)
        return len(pattern) if close < 0 else close + 1
    return i + 2


def class_end(pattern: str, i: int) -> int:
    """End (past the ``]``) of the class starting at ``pattern[i] == "["``. A ``]`` first in
    the class (after an optional ``^``) is a literal, as to ``re``."""
    n, j = len(pattern), i + 1
    j += pattern.startswith("^", j)
    j += pattern.startswith("]", j)
    while j < n and pattern[j] != "]":
        j = escape_end(pattern, j) if pattern[j] == "\\" else j + 1
    return min(j + 1, n)


def regex_tokens(pattern: str) -> list[str]:
    out: list[str] = []
    i, n = 0, len(pattern)
    while i < n:
        ch = pattern[i]
        if ch == "\\":
            j = escape_end(pattern, i)
        elif ch == "[":
            j = class_end(pattern, i)
        elif pattern.startswith("(?#", i):  # a comment runs to the first ")", escapes or not
            close = pattern.find(")", i)
            j = n if close < 0 else close + 1
        elif ch == "(":
            j = _GROUP_OPENING.match(pattern, i).end()
        elif ch == "{" and (m := QUANTIFIER.match(pattern, i)):
            j = m.end()
        else:
            j = i + 1
        out.append(pattern[i:j])
        i = j
    return out
