"""A finished output, parsed and checked against the spec as the user wrote it: JSON through
``json`` and the schema's own validator (patterns read as ECMA-262 does), a regex through
Python's ``re`` meaning (bounded in time, regex_check.py), a Lark grammar through Lark's own
parser (bounded too). This is the last word on "valid": a backend that read the spec more
loosely cannot let an output through.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

from ..errors import OutputValidationError
from ..params import OutputSpec
from .regex_check import ecma_validator_class, python_fullmatch

logger = logging.getLogger(__name__)

__all__ = ["parse_output"]


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
    if spec.grounding is not None:  # grounded values are verbatim spans of the source
        from .grounding import check_grounded

        check_grounded(spec, value)
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
