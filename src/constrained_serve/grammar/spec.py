"""Build a normalized ``OutputSpec`` from user arguments, and parse finished outputs.

The spec's ``text`` is canonical so it can key the compile cache: JSON with sorted keys,
except that the entries of every ``properties`` map keep their order. Both grammar engines
emit object properties in schema order, so that order is part of the grammar's meaning;
fully sorting it would make two different grammars share one cache entry and would reorder
the user's model fields alphabetically in generated output.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import unquote

from ..errors import GrammarError, OutputValidationError
from ..params import OutputSpec
from .regex_check import ecma_validator_class, python_fullmatch

logger = logging.getLogger(__name__)

__all__ = ["make_output_spec", "parse_output", "canonical_json", "resolve_local_ref", "follow_local_refs"]

_GRAMMAR_SYNTAXES = {"lark": "lark", "ebnf": "ebnf", "gbnf": "ebnf"}


def canonical_json(value: Any) -> str:
    """Deterministic JSON text of a schema (see module docstring for the ordering rule)."""
    return json.dumps(_canon(value), separators=(",", ":"), ensure_ascii=False)


# Keywords whose value maps names to schemas; only "properties" keeps its order.
SCHEMA_NAME_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
# Keywords whose value is a list of schemas, and keywords whose value is one schema.
SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SUBSCHEMA_VALUES = (
    "additionalProperties",
    "additionalItems",
    "propertyNames",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "unevaluatedProperties",
    "unevaluatedItems",
    "items",
)
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


def resolve_local_ref(root: Any, ref: str) -> Any:
    """The part of ``root`` a local ``$ref`` points at ("#", "#/$defs/a", "#/a~1b/0");
    None for a pointer into nothing or a plain-name fragment ("#anchor")."""
    if ref != "#" and not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/") if ref != "#" else []:
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def follow_local_refs(schema: Any, root: Any, max_hops: int = 32) -> Any:
    """``schema`` with its local ``$ref`` followed to the target, and the target's, and so on;
    a ``$ref`` that is remote or points nowhere is left as it is."""
    while max_hops and isinstance(schema, dict) and isinstance(schema.get("$ref"), str):
        target = resolve_local_ref(root, schema["$ref"])
        if target is None:
            break
        schema, max_hops = target, max_hops - 1
    return schema


def _schema_from_type(tp: Any) -> tuple[dict, Any]:
    """JSON Schema of a Pydantic model or any type TypeAdapter accepts; keeps the type for parsing."""
    from pydantic import BaseModel, TypeAdapter

    try:
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            return _close_objects(tp.model_json_schema()), tp
        return _close_objects(TypeAdapter(tp).json_schema()), tp
    except Exception as e:  # pydantic raises several error types for unusable types
        raise GrammarError(f"schema: cannot build a JSON Schema from type {tp!r}: {e}", reason=str(e)) from e


def _close_objects(node: Any) -> Any:
    """Pydantic ignores unknown keys by default but leaves ``additionalProperties`` open in the
    schema, so the grammar would let the model invent keys that parsing then drops. Close
    every object that declares properties and says nothing about extras (``extra="allow"``
    models say ``additionalProperties: true`` and stay open)."""
    if isinstance(node, dict):
        for v in node.values():
            _close_objects(v)
        if node.get("type") == "object" and "properties" in node and "additionalProperties" not in node:
            node["additionalProperties"] = False
    elif isinstance(node, list):
        for v in node:
            _close_objects(v)
    return node


def _normalize_schema(schema: Any, arg: str) -> tuple[dict | bool, Any]:
    if isinstance(schema, str):
        try:
            value = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarError(f"{arg}: not valid JSON: {e}", reason=str(e)) from e
        if not isinstance(value, (dict, bool)):
            raise GrammarError(f"{arg}: a JSON Schema must be an object or a boolean, got {type(value).__name__}")
        return value, None
    if isinstance(schema, Mapping):
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
) -> OutputSpec | None:
    """Normalize exactly one output constraint into an ``OutputSpec`` (None: unconstrained)."""
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
        raise GrammarError(f"give at most one output constraint, got {', '.join(given)}")
    if not given:
        return None
    common = {"whitespace": bool(json_whitespace), "strict": bool(strict)}

    if response_format is not None:
        return _from_response_format(response_format, common)
    if schema is not None:
        value, tp = _normalize_schema(schema, "schema")
        return OutputSpec("json_schema", canonical_json(_boolean_schema(value, "schema")), python_type=tp, **common)
    if regex is not None:
        if not isinstance(regex, str) or not regex:
            raise GrammarError(f"regex: expected a non-empty string, got {regex!r}")
        return OutputSpec("regex", regex, **common)
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


def _from_response_format(rf: Mapping[str, Any], common: dict) -> OutputSpec | None:
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
        arg = "response_format.json_schema.schema"
        value, tp = _normalize_schema(js["schema"], arg)
        return OutputSpec("json_schema", canonical_json(_boolean_schema(value, arg)), python_type=tp, **common)
    raise GrammarError(f"response_format: unknown type {kind!r} (expected json_schema, json_object or text)")


def parse_output(spec: OutputSpec, text: str) -> tuple[Any, Any]:
    """Return ``(json_value, parsed)``; for non-JSON kinds ``(None, text)``. ValueError on
    failure: OutputValidationError (with the parsed JSON, if any) when the output the grammar
    accepted is not what the spec means (see ``_check_conformance``) or the Python type refuses it."""
    if not spec.is_json:
        _check_conformance(spec, text, None)
        return None, text
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"output is not valid JSON: {e}") from e
    if spec.python_type is None:
        _check_conformance(spec, text, value)
        return value, value
    from pydantic import TypeAdapter, ValidationError

    adapter = TypeAdapter(spec.python_type)
    try:
        # JSON mode, as the type reads JSON: strict models take ISO dates and UUIDs as strings,
        # and a union "datetime | str" resolves to the datetime (Python mode picked the str).
        return value, adapter.validate_json(text)
    except ValidationError as e:  # the grammar holds the schema, not the type's validators
        if not (all(err["type"] == "json_invalid" for err in e.errors()) and _has_lone_surrogate(value)):
            raise OutputValidationError(f"output does not validate as {spec.python_type!r}: {e}", value) from e
    # A lone surrogate escape ("\\ud800"): valid JSON text, which the grammar allows and
    # json.loads reads, but Pydantic's JSON parser refuses. Validate the value json.loads gave
    # (so json and parsed hold the same string) in Python mode, lax: strict Python mode refuses
    # the ISO datetimes, UUIDs and bytes that JSON mode reads from strings, lax mode takes them.
    # Lax mode's other coercions ("1" for 1) need a value of another JSON type than the schema
    # Pydantic wrote, which the grammar does not let through. One difference remains: a union
    # of str with such a type ("UUID | str") resolves to the str here, to the UUID in JSON mode.
    try:
        return value, adapter.validate_python(value, strict=False)
    except ValidationError as e:
        raise OutputValidationError(f"output does not validate as {spec.python_type!r}: {e}", value) from e


def _has_lone_surrogate(value: Any) -> bool:
    """Does a string (or key) in the JSON value hold a lone surrogate, which UTF-8 cannot encode?"""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _check_conformance(spec: OutputSpec, text: str, value: Any) -> None:
    """The last line of the guarantee. A backend's grammar can be looser than the spec as
    the user reads it (xgrammar and llguidance read some regex classes differently from
    Python's ``re``; a backend may drop a schema keyword no check of ours knew about). Under
    ``strict=True`` a finished regex output must ``re.fullmatch``, a JSON Schema output
    must validate with ``jsonschema`` and a Lark output must parse with ``lark``, its terminals
    read longest-match as the backends read them (see ``_lark_refusal``); otherwise it is
    reported, never passed as valid. (``strict=False`` accepted the approximation; Pydantic
    types are checked by Pydantic.)
    Patterns are matched with a time bound, through ``regex_check``: ``re`` backtracks
    exponentially on some pattern and text pairs, and a text that does not match is exactly
    what this check meets. A match past the bound leaves the output unchecked (a warning)."""
    if not spec.strict:
        return
    if spec.kind == "regex":
        if python_fullmatch(spec.text, text) is False:  # None: cannot be known, so not checked
            raise OutputValidationError(
                "the output does not match the regex as Python's re.fullmatch reads it (the grammar "
                "backend read the pattern differently, e.g. Unicode classes); nothing was repaired",
                None,
            )
    elif spec.kind == "lark":
        refusal = _lark_refusal(spec.text, text)
        if refusal is not None:
            raise OutputValidationError(
                f"the output does not parse with the lark package's reading of the grammar ({refusal}); "
                f"the grammar backend let a terminal stop short of what lark's greedy lexer takes (a "
                f"terminal that can swallow what follows it, see the README); nothing was repaired",
                None,
            )
    elif spec.kind == "json_schema":
        validator = _schema_validator(spec.text)
        error = None
        if validator is not None:
            try:
                error = next(iter(validator.iter_errors(value)), None)
            except Exception:  # noqa: BLE001 - an unresolvable $ref and the like: cannot check here
                logger.debug("jsonschema could not check an output", exc_info=True)
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path) or "the top level"
            raise OutputValidationError(
                f"the output does not validate against the schema at {where}: {error.message} (the grammar "
                f"backend approximated the schema); nothing was repaired",
                value,
            )


# lark's Earley parser is cubic, or worse, on ambiguous grammars (e: e e | A | b, b: A took
# 0.3 s on 64 characters and grows as n^3.5): past this it gives up and the output is left
# unchecked. LALR (linear) goes first and vouches for most outputs on its own.
LARK_EARLEY_TIMEOUT_S = 0.25


class _Deadline(BaseException):
    """Raised inside a lark parse that ran out of time (BaseException: lark's own
    ``except Exception`` clauses must not swallow it)."""


def _call_with_deadline(fn: Callable[[], Any], seconds: float, code_under: str) -> Any:
    """``fn()``, interrupted with ``_Deadline`` once it runs past ``seconds``. For pure Python
    code (lark): a trace function, on this thread only, checks the clock at each call of a
    function defined under the folder ``code_under``. Only there: a garbage-collector
    callback or finalizer that runs meanwhile must not be cut short (its exception would be
    swallowed, and the trace function dropped). One already installed (a debugger,
    coverage) is chained, then restored."""
    deadline = time.perf_counter() + seconds
    previous = sys.gettrace()

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if time.perf_counter() > deadline and frame.f_code.co_filename.startswith(code_under):
            raise _Deadline
        return previous(frame, event, arg) if previous is not None else None

    sys.settrace(tracer)
    try:
        return fn()
    finally:
        sys.settrace(previous)


def _lark_refusal(grammar: str, text: str) -> str | None:
    """Why the ``lark`` package refuses ``text`` for ``grammar``; None when it parses, or when
    lark cannot tell (not installed, cannot read the grammar: llguidance extensions; or an
    Earley parse past ``LARK_EARLEY_TIMEOUT_S``).

    The terminals are read as both backends read them: as regular languages whose longest
    match wins (lark's ``regex=True`` with POSIX leftmost-longest matching). Plain lark, on
    Python's ``re``, takes the first alternative that matches: it lexes "3.14" for
    ``NUMBER: /[0-9]+|[0-9]+[.][0-9]+/`` as "3" and refuses it, though the grammar says yes.

    LALR first, as it is linear; it accepts or cannot decide: lark resolves shift/reduce
    conflicts silently, so its LALR parser refuses some texts the grammar admits. A refusal
    is lark's Earley parser's."""
    lalr, earley = _lark_parsers(grammar)
    if lalr is None and earley is None:
        return None
    import lark

    if lalr is not None:
        try:
            lalr.parse(text)
            return None
        except lark.exceptions.LarkError:
            pass
        except RecursionError:  # a deeply nested text
            logger.debug("lark's LALR parser could not check an output", exc_info=True)
    if earley is None:
        return None
    try:
        _call_with_deadline(lambda: earley.parse(text), LARK_EARLEY_TIMEOUT_S, os.path.dirname(lark.__file__) + os.sep)
        return None
    except _Deadline:
        logger.debug(
            "lark's Earley parser ran past %.2f s on a %d-character output: left unchecked",
            LARK_EARLEY_TIMEOUT_S,
            len(text),
        )
        return None
    except lark.exceptions.UnexpectedInput as e:
        # lark's first line says what and where; "Expected one of:" lists on the lines after
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        return lines[0] + (" " + " ".join(lines[1:4]) if lines[0].endswith(":") else "")
    except Exception:  # noqa: BLE001 - lark failed in its own way: the backend's word stands
        logger.debug("lark could not check an output", exc_info=True)
        return None


@functools.lru_cache(maxsize=64)
def _lark_parsers(grammar: str) -> tuple[Any, Any]:
    """``(lalr, earley)`` parsers of ``grammar``, each None where lark cannot build it."""
    try:
        import lark
        import regex
    except ImportError:
        logger.debug("the lark package is not installed: Lark outputs are not re-checked")
        return None, None
    parsers = []
    for parser in ("lalr", "earley"):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                # The regex package, leftmost-longest: terminals as the backends read them
                # (and [[:alpha:]] as a POSIX class, as Rust's regex reads it).
                parsers.append(lark.Lark(grammar, parser=parser, regex=True, g_regex_flags=regex.POSIX))
        except Exception:  # noqa: BLE001 - a grammar lark cannot read: the backend's word stands
            logger.debug("lark cannot build a %s parser for a grammar", parser, exc_info=True)
            parsers.append(None)
    return parsers[0], parsers[1]


@functools.lru_cache(maxsize=256)
def _schema_validator(schema_text: str) -> Any:
    import jsonschema

    try:
        if '"multipleOf"' in schema_text:  # jsonschema's float division refuses 19.99 for 0.01
            return None
        schema = json.loads(schema_text)
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        cls.check_schema(schema)  # a draft-04 schema without $schema ("exclusiveMinimum": true): no check
        # "pattern" keywords matched as ECMA-262 reads them, with a time bound (regex_check)
        return ecma_validator_class(cls)(schema)
    except Exception:  # noqa: BLE001 - jsonschema cannot read it: the backend's word stands
        logger.debug("jsonschema cannot build a validator for a schema", exc_info=True)
        return None
