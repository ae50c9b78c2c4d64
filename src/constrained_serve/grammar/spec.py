"""Build a normalized ``OutputSpec`` from user arguments (finished outputs are parsed and
checked against it in output_check.py).

The spec's ``text`` is canonical so it can key the compile cache: JSON with sorted keys,
except that the entries of every ``properties`` map keep their order. Both grammar engines
emit object properties in schema order, so that order is part of the grammar's meaning;
fully sorting it would make two different grammars share one cache entry and would reorder
the user's model fields alphabetically in generated output.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import GrammarError
from ..params import OutputSpec
from .ascii_classes import ascii_classes, ascii_schema_patterns
from .schema_walk import SCHEMA_NAME_MAPS, follow_local_refs, resolve_local_ref

logger = logging.getLogger(__name__)

__all__ = ["make_output_spec", "canonical_json", "resolve_local_ref", "follow_local_refs"]

_GRAMMAR_SYNTAXES = {"lark": "lark", "ebnf": "ebnf", "gbnf": "ebnf"}


def canonical_json(value: Any) -> str:
    """Deterministic JSON text of a schema (see module docstring for the ordering rule)."""
    return json.dumps(_canon(value), separators=(",", ":"), ensure_ascii=False)


# Keywords whose value is data, not a schema: a key "properties" in there means nothing.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})


def _canon(value: Any, schema: bool = True) -> Any:
    """``schema``: ``value`` is a schema (or a list of them), so its name maps are known; a
    name map's entries are schemas again, whatever they are called (a ``$defs`` entry named
    "properties" is a schema, not a properties map)."""
    if isinstance(value, Mapping):
        out = {}
        for k in sorted(value.keys(), key=str):
            v = value[k]
            if schema and k in SCHEMA_NAME_MAPS and isinstance(v, Mapping):
                names = list(v) if k == "properties" else sorted(v, key=str)
                out[k] = {n: _canon(v[n]) for n in names}
            else:
                out[k] = _canon(v, schema and k not in _DATA_KEYWORDS)
        return out
    if isinstance(value, (list, tuple)):
        return [_canon(v, schema) for v in value]
    return value


def _schema_from_type(tp: Any) -> tuple[dict, Any]:
    """JSON Schema of a Pydantic model or any type TypeAdapter accepts; keeps the type for parsing."""
    from pydantic import BaseModel, TypeAdapter

    try:
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            return tp.model_json_schema(), tp
        return TypeAdapter(tp).json_schema(), tp
    except Exception as e:  # pydantic raises several error types for unusable types
        raise GrammarError(f"schema: cannot build a JSON Schema from type {tp!r}: {e}", reason=str(e)) from e


# Deeper schemas are refused with a clear error before anything recurses into them (json,
# the closing of objects, the backends): real schemas nest a few dozen levels at most.
MAX_SCHEMA_DEPTH = 128


def _check_depth(value: Any, arg: str) -> None:
    """GrammarError if ``value`` (dicts and lists) nests deeper than MAX_SCHEMA_DEPTH; iterative."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarError(
                f"{arg}: the schema nests deeper than {MAX_SCHEMA_DEPTH} levels (objects and lists "
                "inside each other); flatten it or use $defs and $ref",
                reason="nested too deeply",
            )
        if isinstance(node, Mapping):
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, (Mapping, list, tuple)))
        elif isinstance(node, (list, tuple)):
            stack.extend((v, depth + 1) for v in node if isinstance(v, (Mapping, list, tuple)))


def _normalize_schema(schema: Any, arg: str) -> tuple[dict | bool, Any]:
    try:
        return _normalize_schema_unguarded(schema, arg)
    except RecursionError as e:  # a depth check missed a path (a type pydantic recursed into)
        raise GrammarError(f"{arg}: the schema nests too deeply to read", reason="nested too deeply") from e


def _normalize_schema_unguarded(schema: Any, arg: str) -> tuple[dict | bool, Any]:
    if isinstance(schema, str):
        if schema.count("{") + schema.count("[") > MAX_SCHEMA_DEPTH:  # cheap pre-check, then exact
            _check_depth(_shallow_nesting(schema), arg)
        try:
            value = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarError(f"{arg}: not valid JSON: {e}", reason=str(e)) from e
        if not isinstance(value, (dict, bool)):
            raise GrammarError(f"{arg}: a JSON Schema must be an object or a boolean, got {type(value).__name__}")
        return value, None
    if isinstance(schema, Mapping):
        _check_depth(schema, arg)
        try:
            return json.loads(json.dumps(schema)), None  # deep copy, and proves it is JSON
        except (TypeError, ValueError) as e:
            raise GrammarError(f"{arg}: schema dict is not JSON-serializable: {e}", reason=str(e)) from e
    if isinstance(schema, bool):
        return schema, None
    if isinstance(schema, (int, float, list, tuple, set, bytes)):
        raise GrammarError(
            f"{arg}: expected a dict, a JSON string, a Pydantic model or a type, got {type(schema).__name__}"
        )
    # Anything else may be a type pydantic understands (model, dataclass, TypedDict,
    # list[Model], Optional[...], int | None, Annotated[...]); pydantic decides.
    return _schema_from_type(schema)


def _shallow_nesting(text: str) -> list:
    """A stand-in of a JSON text's bracket nesting (one list per level reached), so that
    _check_depth sees a deep text before json.loads recurses into it."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "}]":
            depth -= 1
    nest: list = []
    for _ in range(min(deepest, MAX_SCHEMA_DEPTH + 1) - 1):
        nest = [nest]
    return nest


def _json_schema_spec(schema: Any, arg: str, common: dict, open_objects: bool) -> OutputSpec:
    """The spec of a JSON Schema argument, its objects closed (closed_objects.py) unless
    ``open_objects``. A Pydantic model or type is always closed: Pydantic ignores unknown
    keys by default but leaves its schema open, so the grammar would let the model invent
    keys that parsing then drops (``extra="allow"`` says ``additionalProperties: true``)."""
    from .closed_objects import close_objects

    value, tp = _normalize_schema(schema, arg)
    _check_depth(value, arg)  # a type's schema too
    if tp is not None or not open_objects:
        value = close_objects(value)
    value = ascii_schema_patterns(value)  # \d and \w as ECMA-262 reads them
    return OutputSpec("json_schema", canonical_json(_boolean_schema(value, arg)), python_type=tp, **common)


def _boolean_schema(value: dict | bool, arg: str) -> dict:
    """The boolean schemas of JSON Schema: ``true`` accepts any JSON value, the same as
    ``{}`` (which the backends take); ``false`` accepts none."""
    if value is True:
        return {}
    if value is False:
        raise GrammarError(f"{arg}: the schema false matches no JSON value", reason="matches no text")
    return value


def make_output_spec(
    *,
    schema: Any = None,
    regex: str | None = None,
    grammar: str | None = None,
    grammar_syntax: str = "lark",
    choices: Sequence[str] | None = None,
    response_format: Mapping[str, Any] | None = None,
    json_whitespace: bool = False,
    strict: bool = True,
    json_open_objects: bool = False,
    unicode_classes: bool = False,
) -> OutputSpec | None:
    """Normalize exactly one output constraint into an ``OutputSpec`` (None: unconstrained).

    A JSON Schema's objects that declare ``properties`` and say nothing about extra keys are
    closed (``additionalProperties: false``, see closed_objects.py); ``json_open_objects=True``
    keeps JSON Schema's literal meaning (open objects) for schemas given as JSON, except
    under ``response_format``'s ``"strict": true``, which always closes them.

    ``\\d`` and ``\\w`` are ASCII (``[0-9]``, ``[0-9A-Za-z_]``) in a JSON Schema ``pattern``,
    as ECMA-262 says, and in ``regex=``; ``unicode_classes=True`` keeps the backend's Unicode
    classes for ``regex=`` (see ascii_classes.py)."""
    given = [
        n
        for n, v in (
            ("schema", schema),
            ("regex", regex),
            ("grammar", grammar),
            ("choices", choices),
            ("response_format", response_format),
        )
        if v is not None
    ]
    if len(given) > 1:
        raise TypeError(f"give at most one output constraint, got {', '.join(given)}")
    if not given:
        return None
    common = {"whitespace": bool(json_whitespace), "strict": bool(strict)}

    if response_format is not None:
        return _from_response_format(response_format, common, bool(json_open_objects))
    if schema is not None:
        return _json_schema_spec(schema, "schema", common, bool(json_open_objects))
    if regex is not None:
        if not isinstance(regex, str) or not regex:
            raise GrammarError(f"regex: expected a non-empty string, got {regex!r}")
        _check_regex_syntax(regex)
        return OutputSpec("regex", regex if unicode_classes else ascii_classes(regex), **common)
    if grammar is not None:
        if not isinstance(grammar, str) or not grammar.strip():
            raise GrammarError(f"grammar: expected a non-empty string, got {grammar!r}")
        kind = _GRAMMAR_SYNTAXES.get(str(grammar_syntax).lower())
        if kind is None:
            raise GrammarError(f"grammar_syntax: expected 'lark', 'ebnf' or 'gbnf', got {grammar_syntax!r}")
        return OutputSpec(kind, grammar, **common)  # type: ignore[arg-type]
    # choices
    if isinstance(choices, (str, bytes)) or not isinstance(choices, Sequence):
        raise GrammarError(f"choices: expected a list of strings, got {type(choices).__name__}")
    items = list(choices)
    if not items or not all(isinstance(c, str) and c for c in items):
        raise GrammarError("choices: expected a non-empty list of non-empty strings")
    return OutputSpec("choices", json.dumps(items, ensure_ascii=False), **common)


# re's errors for syntax that is invalid in every dialect (Rust's, which the backends read,
# included); others may be Rust-only syntax (\p{L}, nested classes) that the backends take.
_INVALID_EVERYWHERE = (
    "multiple repeat",
    "nothing to repeat",
    "missing ), unterminated subpattern",
    "unbalanced parenthesis",
    "unterminated character set",
)


def _check_regex_syntax(regex: str) -> None:
    import re
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            re.compile(regex)
    except re.error as e:
        if e.msg in _INVALID_EVERYWHERE:
            where = f" at position {e.pos}" if e.pos is not None else ""
            snippet = regex if len(regex) <= 200 else regex[:200] + "..."
            raise GrammarError(
                f"regex {snippet!r} is not a valid regular expression: {e.msg}{where}", reason=e.msg
            ) from None
    except (RecursionError, OverflowError):  # too large for re: the backend decides
        pass


def _from_response_format(rf: Mapping[str, Any], common: dict, open_objects: bool) -> OutputSpec | None:
    if not isinstance(rf, Mapping) or "type" not in rf:
        raise GrammarError("response_format: expected a dict with a 'type' key")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputSpec("json_object", canonical_json({"type": "object"}), **common)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, Mapping) or "schema" not in js:
            raise GrammarError("response_format: 'json_schema' needs {'json_schema': {'schema': {...}}}")
        # OpenAI's "strict": true promises closed objects whatever json_open_objects says.
        open_objects = open_objects and js.get("strict") is not True
        return _json_schema_spec(js["schema"], "response_format.json_schema.schema", common, open_objects)
    raise GrammarError(f"response_format: unknown type {kind!r} (expected json_schema, json_object or text)")
