"""Grounded string fields: values that may only be a verbatim span of the source text.

Which fields. A string subschema is grounded when it says ``"x-grounded": true`` (or
``"words"`` / ``"chars"``, its unit), or, under ``Grounding.all_strings``
(``grounded=True``), when it is a string: ``"type": "string"`` without ``enum``, ``const``
or ``format``, which keep their own constraint (and ``"x-grounded": false`` opts a field
out). A nullable one (``"type": ["string", "null"]``, ``anyOf`` with ``null``,
``Optional[Grounded]``) may still be null. ``minLength``/``maxLength`` and ``pattern`` hold as
well: grounded_lark.py intersects them with the span, so a grounded field with a pattern
takes only a span of the source that matches it, and a nullable one whose pattern no span
matches can only be null. ``"x-null-if-no-match": true`` on such a field (typed ``["string",
"null"]``, with a pattern and a maxLength) turns that around as well: it may be null only
where no span matches, so where one does it takes one (has_matching_span decides, per
source, before the grammar is written).

The units. A source is cut into chunks: in words, each run of word characters (``\\w``:
letters, digits, ``_``, in any script) is one chunk and every other character one of its
own; in chars, every character is a chunk. A span is a run of whole chunks, so a word span
never starts or ends inside a word ("ohn" is not a span of "John").

JSON escaping. The value is written inside a JSON string, so each chunk is JSON-escaped on
its own and the grammar's substring runs over the escaped chunks (grounded_lark.py). JSON
escaping maps one character at a time, so the escaped chunks concatenate to the escaped span,
a span can never end inside an escape (``\\"`` or ``\\n`` is inside one chunk), and the one
spelling each chunk has decodes back to it: the parsed value is always a verbatim span.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from ..errors import OutputValidationError
from ..params import Grounding, OutputSpec
from .schema_walk import follow_local_refs

__all__ = [
    "GROUNDED_KEY",
    "NULL_IF_NO_MATCH_KEY",
    "has_matching_span",
    "chunks",
    "escaped",
    "grounded_unit",
    "has_grounded_marks",
    "grounded_values",
    "find_span",
    "spans_of",
    "check_grounded",
    "grounded_type",
]

GROUNDED_KEY = "x-grounded"
NULL_IF_NO_MATCH_KEY = "x-null-if-no-match"
# Characters JSON escapes: a grounded field with a pattern never quotes a span holding one.
_ESCAPED = re.compile(r'["\\\x00-\x1f]')
_WORDS = re.compile(r"\w+|\W", re.UNICODE | re.DOTALL)
# Keywords that constrain a string otherwise: such a field keeps them and is not grounded,
# whatever it or grounded=True says. (A pattern is intersected with the span instead.)
OWN_CONSTRAINT = ("enum", "const", "format")


def chunks(text: str, unit: str) -> list[str]:
    """``text`` cut into the units a span is made of (module docstring)."""
    if unit == "chars":
        return list(text)
    return _WORDS.findall(text)


def escaped(chunk: str) -> str:
    """A chunk as it stands inside a JSON string (json.dumps' escapes, non-ASCII kept). A lone
    surrogate, which UTF-8 cannot carry, is written as its ``\\uXXXX`` escape."""
    out = json.dumps(chunk, ensure_ascii=False)[1:-1]
    try:
        out.encode("utf-8")
    except UnicodeEncodeError:
        out = json.dumps(chunk)[1:-1]
    return out


def _types(node: dict) -> list[str]:
    t = node.get("type")
    return [t] if isinstance(t, str) else [x for x in t if isinstance(x, str)] if isinstance(t, list) else []


def grounded_unit(node: Any, grounding: Grounding) -> str | None:
    """The unit ("words"/"chars") of a grounded string subschema; None when ``node`` is not one."""
    if not isinstance(node, dict) or "string" not in _types(node) or any(k in node for k in OWN_CONSTRAINT):
        return None
    mark = node.get(GROUNDED_KEY)
    if mark in ("words", "chars"):
        return mark
    if mark is True or (mark is None and grounding.all_strings):
        return grounding.unit
    return None


def has_grounded_marks(schema: Any) -> bool:
    """Does any subschema say ``"x-grounded"`` (truthy)? A cheap scan of the JSON text."""
    if isinstance(schema, dict):
        if schema.get(GROUNDED_KEY) not in (None, False):
            return True
        return any(has_grounded_marks(v) for v in schema.values())
    if isinstance(schema, list):
        return any(has_grounded_marks(v) for v in schema)
    return False


def grounded_values(
    node: Any, value: Any, grounding: Grounding, root: Any, path: str = "$", depth: int = 0
) -> Iterator[tuple[str, str, str]]:
    """(JSON path, string, unit) for each grounded string in ``value``, walked beside its
    schema. Paths are written as Result.field_confidence writes them ("$.name", "$.items[0]")."""
    if depth > 64 or not isinstance(node, dict):
        return
    node = follow_local_refs(node, root)
    if not isinstance(node, dict):
        return
    if isinstance(value, str):
        unit = grounded_unit(node, grounding)
        if unit is not None:
            yield path, value, unit
            return
    for key in ("anyOf", "oneOf", "allOf"):
        for branch in node.get(key) or []:
            found = list(grounded_values(branch, value, grounding, root, path, depth + 1))
            if found:
                yield from found
                return
    if isinstance(value, dict):
        props = node.get("properties") or {}
        for k, v in value.items():
            if k in props:
                yield from grounded_values(props[k], v, grounding, root, f"{path}.{k}", depth + 1)
    elif isinstance(value, list):
        items = node.get("items")
        for i, v in enumerate(value):
            yield from grounded_values(items, v, grounding, root, f"{path}[{i}]", depth + 1)


def has_matching_span(sources: tuple[str, ...], unit: str, pattern: str, min_length: int, max_length: int) -> bool:
    """Is some span of the sources (whole ``unit`` chunks, ``min_length`` to ``max_length``
    characters, none that JSON escapes) matched by ``pattern`` (a JSON Schema pattern, read
    as ECMA-262 does)? O(chunks x max_length). A match that cannot be decided in time counts
    as none: the field then keeps its null."""
    from .regex_check import ecma_search

    for source in sources:
        parts = chunks(source, unit)
        for i in range(len(parts)):
            text = ""
            for part in parts[i:]:
                text += part
                if len(text) > max_length or _ESCAPED.search(part):
                    break
                if len(text) >= min_length and ecma_search(pattern, text) is True:
                    return True
    return False


def find_span(source: str, value: str, unit: str) -> tuple[int, int] | None:
    """The first occurrence of ``value`` in ``source`` made of whole chunks (start, end), or None."""
    if unit == "chars":
        at = source.find(value)
        return None if at < 0 else (at, at + len(value))
    bounds = {0, len(source)}
    pos = 0
    for c in _WORDS.findall(source):
        pos += len(c)
        bounds.add(pos)
    at = source.find(value)
    while at >= 0:
        if at in bounds and at + len(value) in bounds:
            return at, at + len(value)
        at = source.find(value, at + 1)
    return None


def _spans(spec: OutputSpec, value: Any) -> Iterator[tuple[str, str, tuple[int, int] | None]]:
    grounding = spec.grounding
    if grounding is None or not spec.is_json:
        return
    schema = json.loads(spec.text)
    text = grounding.text
    for path, s, unit in grounded_values(schema, value, grounding, schema):
        if not s:
            continue  # the empty span is everywhere: no offsets to give
        span = None
        for i, part in enumerate(grounding.sources):  # a span lies inside one source
            hit = find_span(part, s, unit)
            if hit is not None:
                offset = sum(len(p) + len(Grounding.SEPARATOR) for p in grounding.sources[:i])
                span = (hit[0] + offset, hit[1] + offset)
                break
        assert span is None or text[span[0] : span[1]] == s
        yield path, s, span


def spans_of(spec: OutputSpec, value: Any) -> dict[str, tuple[int, int]]:
    """Result.spans: per JSON path of a non-empty grounded value, its first occurrence in the
    grounding's text (character offsets, end exclusive)."""
    return {path: span for path, _, span in _spans(spec, value) if span is not None}


def check_grounded(spec: OutputSpec, value: Any) -> None:
    """OutputValidationError if a grounded value is not a span of the source (the grammar
    makes that impossible; this is the last word, as output_check.py is for the schema)."""
    for path, s, span in _spans(spec, value):
        if span is None:
            raise OutputValidationError(
                f"the grounded value at {path} ({s[:60]!r}) is not a verbatim span of the source text; "
                "nothing was repaired",
                value,
            )


def grounded_type(unit: bool | str = True) -> Any:
    """``constrained_serve.Grounded``: ``Annotated[str, Field(json_schema_extra={"x-grounded":
    unit})]``, a Pydantic field type whose values quote the source (``Grounded | None``: or null)."""
    from typing import Annotated

    from pydantic import Field

    return Annotated[str, Field(json_schema_extra={GROUNDED_KEY: unit})]
