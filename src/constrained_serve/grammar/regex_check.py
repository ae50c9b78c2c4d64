"""Regex matching with a time bound, for the final conformance check (``output_check._check_conformance``).

Python's ``re`` backtracks without a bound: ``re.fullmatch(r"(\\w+\\s?)+", "a" * 30 + "!")``
runs for minutes, and a finished output that a backend read differently from ``re`` (the
very case the check is there for) is exactly a text that does not match. The ``regex``
package takes a ``timeout``, but reads some of the same syntax otherwise (checked on regex
2026.11.19, Python 3.11):

- its ``\\w``, ``\\d`` and ``\\s`` follow its own Unicode tables and definitions: its ``\\w``
  takes the combining marks, 30,468 code points that ``re``'s ``\\w`` refuses;
- ``a{e<=1}`` is a fuzzy match, where ``re`` reads the literal text;
- ``[:digit:]`` inside a class is a POSIX class, where ``re`` reads the characters;
- case-insensitive matching folds some characters otherwise (``ı`` against ``[a-z]``).

So a pattern is first compiled by ``re`` (what ``re`` refuses, or warns about as a possible
nested set or set operation, is Rust-only syntax: not checked), then rewritten for ``regex`` so that it reads
as intended: each class escape becomes explicit code-point ranges (for Python's meaning,
computed once by ``re`` itself over every code point; for a JSON Schema ``pattern``,
ECMA-262's), a ``{`` that is no quantifier and a ``[`` inside a class are escaped. What has
no exact rewrite (``\\b``, ``\\B``, the inline flags ``a``, ``i`` and ``x``) is not checked.
A match still running at the timeout is not checked either, and says so in a warning.
"""

from __future__ import annotations

import functools
import logging
import re
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import regex

from .regex_scan import escape_end, regex_tokens

logger = logging.getLogger(__name__)

__all__ = ["MATCH_TIMEOUT_S", "python_fullmatch", "ecma_search", "ecma_validator_class"]

# A sane match of a generated output takes microseconds; past this, the pattern backtracks
# exponentially on this text. Long enough not to give up on a busy machine.
MATCH_TIMEOUT_S = 0.25

Ranges = list[tuple[int, int]]

# ECMA-262 (what JSON Schema's "pattern" means): \w and \d are ASCII; \s is WhiteSpace
# (TAB, VT, FF, ZWNBSP and the Zs category) plus LineTerminator (LF, CR, LS, PS).
_ECMA_CLASSES: dict[str, Ranges] = {
    "w": [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)],
    "d": [(0x30, 0x39)],
    "s": [
        (0x09, 0x0D),
        (0x20, 0x20),
        (0xA0, 0xA0),
        (0x1680, 0x1680),
        (0x2000, 0x200A),
        (0x2028, 0x2029),
        (0x202F, 0x202F),
        (0x205F, 0x205F),
        (0x3000, 0x3000),
        (0xFEFF, 0xFEFF),
    ],
}
# Inline flags, global "(?sm)" or scoped "(?s-m:...)": only s, m and u mean the same to regex.
_FLAGS = re.compile(r"\(\?([aiLmsux]*)(?:-([imsx]*))?[:)]")
_SAME_FLAGS = frozenset("smu")


class Untranslatable(ValueError):
    """A construct the rewrite for ``regex`` cannot keep exact."""


def _complement(ranges: Ranges) -> Ranges:
    out, start = [], 0
    for lo, hi in ranges:
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= 0x10FFFF:
        out.append((start, 0x10FFFF))
    return out


def _body(ranges: Ranges) -> str:
    return "".join(f"\\U{lo:08X}" if lo == hi else f"\\U{lo:08X}-\\U{hi:08X}" for lo, hi in ranges)


def _tables(classes: dict[str, Ranges]) -> dict[str, str]:
    """Class body (for inside "[...]") of each escape, lower case and its complement."""
    out = {}
    for letter, ranges in classes.items():
        out[letter] = _body(ranges)
        out[letter.upper()] = _body(_complement(ranges))
    return out


@functools.lru_cache(maxsize=1)
def _python_tables() -> dict[str, str]:
    """``re``'s own \\w, \\d, \\s for str patterns, read off every code point (~0.1 s, once):
    exact for this Python, whatever Unicode version ``regex`` was built with."""
    every = "".join(map(chr, range(0x110000)))
    return _tables({c: [(m.start(), m.end() - 1) for m in re.finditer(f"\\{c}+", every)] for c in "wds"})


@functools.lru_cache(maxsize=1)
def _ecma_tables() -> dict[str, str]:
    return _tables(_ECMA_CLASSES)


def _class(token: str, tables: dict[str, str]) -> str:
    """A class token (regex_scan.class_end) rewritten for ``regex``."""
    out, j, end = ["["], 1, len(token) - 1  # token[end] is its closing "]"
    if token.startswith("[", j):  # re warns "Possible nested set": [[:alpha:]] is Rust syntax
        raise Untranslatable("a nested set")
    if token.startswith("^", j):
        out.append("^")
        j += 1
    if token.startswith("]", j):  # first in the class: a literal to re
        out.append("\\]")
        j += 1
    content = j
    while j < end:
        if token[j] in "-&~|" and token.startswith(token[j], j + 1) and j > content:
            raise Untranslatable("a set operation")  # re warns: "a&&b", "a--b" mean sets in Rust
        if token[j] == "\\":
            k = escape_end(token, j)
            esc = token[j:k]
            out.append(tables[esc[1]] if esc[1:] in tables else esc)
            j = k
        else:
            # "[" is a literal inside a class to re; regex reads "[:digit:]" as a POSIX class.
            out.append("\\[" if token[j] == "[" else token[j])
            j += 1
    out.append("]")
    return "".join(out)


def _rewrite(pattern: str, tables: dict[str, str]) -> str:
    """``pattern`` (which ``re`` compiled) as ``regex`` must read it to mean the same."""
    out: list[str] = []
    for t in regex_tokens(pattern):
        if t.startswith("\\"):
            if t in ("\\b", "\\B"):  # word boundaries by a \w of regex's own
                raise Untranslatable(t)
            out.append(f"[{tables[t[1]]}]" if t[1:] in tables else t)
        elif t.startswith("["):
            out.append(_class(t, tables))
        elif t == "{":
            out.append("\\{")  # no quantifier: regex reads "{e<=1}" as a fuzzy match
        elif (m := _FLAGS.fullmatch(t)) and t not in ("(?:", "(?)"):
            if set(m.group(1) + (m.group(2) or "")) - _SAME_FLAGS:
                raise Untranslatable(t)
            out.append(t)
        else:
            out.append(t)
    return "".join(out)


@functools.lru_cache(maxsize=512)
def _compiled(pattern: str, dialect: str) -> Any:
    """The ``regex`` pattern meaning what ``pattern`` means to ``re`` ("python") or to
    ECMA-262's class escapes ("ecma"); None where there is none (then: no check)."""
    try:
        # Only its errors count: re caches compiled patterns, so its warnings come once per
        # process ("Possible nested set", which _class finds itself).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            re.compile(pattern)
    except (re.error, RecursionError, OverflowError):  # Rust-only syntax (\p{L}, \z)
        return None
    try:
        return regex.compile(_rewrite(pattern, _python_tables() if dialect == "python" else _ecma_tables()))
    except Untranslatable as e:
        logger.debug("pattern %r: %s has no exact rewrite for the regex package; not checked", pattern, e)
    except (regex.error, RecursionError, OverflowError, ValueError):
        logger.debug("the regex package cannot compile the rewrite of %r; not checked", pattern, exc_info=True)
    return None


def _bounded(pattern: str, dialect: str, run: Callable[[Any], Any]) -> bool | None:
    compiled = _compiled(pattern, dialect)
    if compiled is None:
        return None
    try:
        return run(compiled) is not None
    except TimeoutError:
        logger.warning(
            "matching an output against the pattern %r ran past %.2f s (exponential backtracking); "
            "the output is left unchecked",
            pattern,
            MATCH_TIMEOUT_S,
        )
        return None


def python_fullmatch(pattern: str, text: str) -> bool | None:
    """``re.fullmatch(pattern, text) is not None`` within ``MATCH_TIMEOUT_S``; None when that
    cannot be known (syntax ``re`` refuses, no exact rewrite, timeout)."""
    return _bounded(pattern, "python", lambda c: c.fullmatch(text, timeout=MATCH_TIMEOUT_S))


def ecma_search(pattern: str, text: str) -> bool | None:
    """Does a JSON Schema ``pattern`` match somewhere in ``text``, with ECMA-262's \\w, \\d, \\s
    (ASCII words and digits; \\W takes "é") within ``MATCH_TIMEOUT_S``; None when that cannot
    be known. Elsewhere the pattern is read as ``re`` reads it; where that differs from
    ECMA-262 (``.`` takes CR and U+2028, ``$`` matches before a final newline) ``re`` takes
    more, so the check can miss an output there, never refuse a valid one."""
    return _bounded(pattern, "ecma", lambda c: c.search(text, timeout=MATCH_TIMEOUT_S))


# -- jsonschema keywords that match patterns ------------------------------------------------
# jsonschema calls re.search for "pattern", "patternProperties" and the patternProperties
# part of "additionalProperties": unbounded, and with Python's Unicode \w where JSON Schema
# means ECMA-262's (it refused "é" for "^\\W+$", which both backends rightly accept). These
# keep jsonschema's logic and messages with ecma_search. An unknown match (None) never
# makes an error: a pattern counts as matching for "additionalProperties", and its
# patternProperties subschema is not applied. ("unevaluatedProperties" still uses re.)


def _pattern(validator: Any, patrn: str, instance: Any, schema: dict) -> Iterator[Any]:
    from jsonschema.exceptions import ValidationError

    if validator.is_type(instance, "string") and ecma_search(patrn, instance) is False:
        yield ValidationError(f"{instance!r} does not match {patrn!r}")


def _pattern_properties(validator: Any, patterns: dict, instance: Any, schema: dict) -> Iterator[Any]:
    if not validator.is_type(instance, "object"):
        return
    for patrn, subschema in patterns.items():
        for k, v in instance.items():
            if ecma_search(patrn, k):
                yield from validator.descend(v, subschema, path=k, schema_path=patrn)


def _additional_properties(validator: Any, ap: Any, instance: Any, schema: dict) -> Iterator[Any]:
    from jsonschema._utils import extras_msg
    from jsonschema.exceptions import ValidationError

    if not validator.is_type(instance, "object"):
        return
    properties = schema.get("properties", {})
    patterns = list(schema.get("patternProperties", {}))
    extras = {k for k in instance if k not in properties and all(ecma_search(p, k) is False for p in patterns)}
    if validator.is_type(ap, "object"):
        for extra in extras:
            yield from validator.descend(instance[extra], ap, path=extra)
    elif not ap and extras:
        if "patternProperties" in schema:
            verb = "does" if len(extras) == 1 else "do"
            joined = ", ".join(repr(each) for each in sorted(extras))
            listed = ", ".join(repr(each) for each in sorted(schema["patternProperties"]))
            yield ValidationError(f"{joined} {verb} not match any of the regexes: {listed}")
        else:
            yield ValidationError(
                "Additional properties are not allowed ({} {} unexpected)".format(*extras_msg(sorted(extras, key=str)))
            )


@functools.cache
def ecma_validator_class(cls: type) -> type:
    """The jsonschema validator class ``cls`` with its pattern keywords on ``ecma_search``."""
    import jsonschema

    mine = {
        "pattern": _pattern,
        "patternProperties": _pattern_properties,
        "additionalProperties": _additional_properties,
    }
    return jsonschema.validators.extend(cls, {k: f for k, f in mine.items() if k in cls.VALIDATORS})
