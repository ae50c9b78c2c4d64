"""A JSON Schema rewritten so that xgrammar (checked on 0.2.9) means what JSON Schema means.

xgrammar's converter reads some schemas otherwise than JSON Schema does, in both directions.
Where an exact rewrite exists, the schema is rewritten before it reaches xgrammar; what has
none is reported, so that ``strict=True`` refuses it (``xgrammar_gaps.py`` lists the rest):

- ``enum``/``const`` next to ``type`` or other keywords: xgrammar checks only the values
  (``{"type": "string", "enum": ["a", 1]}`` took ``1``). The values that fail the other
  keywords are dropped, which is what the schema means.
- ``pattern`` is a search in JSON Schema; xgrammar matches the whole string (``^pkg:``
  refused "pkg:serializer1"). Unanchored ends get ``[\\s\\S]*``; an anchor that is not at
  the start or end of a top-level alternative has no rewrite and is reported.
- A subschema without ``type`` that holds keywords of one type (``items``, ``properties``,
  ``minLength``...) is any value in JSON Schema (the keywords apply to that type only);
  xgrammar forced that type (``{"items": ...}`` refused ``5``). It becomes an ``anyOf`` over
  the JSON types, each with its own keywords.
- ``minLength``/``maxLength`` strings took no escape at all (``"a\\"b"`` was refused) and took
  raw control characters (invalid JSON): ``ebnf_with_string_escapes`` mends the rules
  xgrammar generates for them (see the xgrammar backend).
"""

from __future__ import annotations

import copy
import re
from typing import Any

from jsonschema import Draft202012Validator

from ..errors import GrammarError
from .regex_scan import regex_tokens
from .schema_walk import SCHEMA_NAME_MAPS, SUBSCHEMA_LISTS, SUBSCHEMA_VALUES

__all__ = ["NEVER", "ebnf_with_string_escapes", "rewrite_schema", "search_pattern"]

_BY_TYPE = {
    "object": (
        "properties",
        "required",
        "additionalProperties",
        "patternProperties",
        "minProperties",
        "maxProperties",
        "propertyNames",
        "dependentRequired",
        "dependentSchemas",
        "unevaluatedProperties",
    ),
    "array": (
        "items",
        "prefixItems",
        "minItems",
        "maxItems",
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "additionalItems",
        "unevaluatedItems",
    ),
    "string": ("minLength", "maxLength", "pattern", "format", "contentEncoding", "contentMediaType"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
}
_TYPED = frozenset(k for ks in _BY_TYPE.values() for k in ks)
_SPLIT_TYPES = ("object", "array", "string", "number", "boolean", "null")  # the branches of a split, in order
_ANY = r"[\s\S]*"


class _Never:
    """A subschema that matches no value (xgrammar has no ``false`` schema)."""


NEVER = _Never()


def rewrite_schema(schema: Any) -> tuple[Any, list[str]]:
    """(the rewritten schema, what could not be rewritten: JSON pointers with a reason)."""
    notes: list[str] = []
    out = _Rewriter(notes).rewrite(copy.deepcopy(schema), "#")
    if out is NEVER:
        raise GrammarError(
            "xgrammar cannot compile json_schema: Unsatisfiable schema: it matches no value (no "
            "enum/const value satisfies its other keywords)",
            backend="xgrammar",
            reason="unsatisfiable schema",
        )
    return out, notes


class _Rewriter:
    def __init__(self, notes: list[str]):
        self.notes = notes
        self.moves: list[tuple[str, str]] = []  # (old pointer prefix, new one) of split subschemas

    def rewrite(self, s: Any, path: str) -> Any:
        out = _rewrite(s, path, self.notes, self)
        if self.moves:
            self._move_refs(out)
        return out

    def _move_refs(self, s: Any) -> None:
        if isinstance(s, dict):
            ref = s.get("$ref")
            if isinstance(ref, str):
                for old, new in sorted(self.moves, key=lambda m: -len(m[0])):  # innermost first
                    if ref == old or ref.startswith(old + "/"):
                        ref = new + ref[len(old) :]
                s["$ref"] = ref
            for v in s.values():
                self._move_refs(v)
        elif isinstance(s, list):
            for v in s:
                self._move_refs(v)


def _rewrite(s: Any, path: str, notes: list[str], ctx: "_Rewriter") -> Any:
    if not isinstance(s, dict):
        return s
    for key in sorted(SCHEMA_NAME_MAPS - {"properties"}):
        sub = s.get(key)
        if isinstance(sub, dict):
            s[key] = {
                name: _kept(_rewrite(v, f"{path}/{key}/{name}", notes, ctx), f"{path}/{key}/{name}", v, notes)
                for name, v in sub.items()
            }
    if isinstance(s.get("properties"), dict) and _never_properties(s, path, notes, ctx):
        return NEVER
    for key in SUBSCHEMA_LISTS:
        if isinstance(s.get(key), list):
            subs = [_rewrite(v, f"{path}/{key}/{i}", notes, ctx) for i, v in enumerate(s[key])]
            if key in ("anyOf", "oneOf"):
                subs = [x for x in subs if x is not NEVER]
                if not subs:
                    return NEVER
            elif NEVER in subs:  # allOf, prefixItems: a part that matches nothing
                if key == "allOf":
                    return NEVER
                notes.append(f"{path}/{key} (an item that matches no value)")
                subs = [x if x is not NEVER else s[key][i] for i, x in enumerate(subs)]
            s[key] = subs
    for key in SUBSCHEMA_VALUES:
        sub = s.get(key)
        if isinstance(sub, list):  # draft-7 tuple "items"
            s[key] = [
                _kept(_rewrite(v, f"{path}/{key}/{i}", notes, ctx), f"{path}/{key}/{i}", v, notes)
                for i, v in enumerate(sub)
            ]
        elif isinstance(sub, dict):
            x = _rewrite(sub, f"{path}/{key}", notes, ctx)
            if x is NEVER and key == "additionalProperties":
                s[key] = False
            elif x is NEVER and key == "items":  # only the empty array
                if s.get("minItems", 0) > 0:
                    return NEVER
                del s[key]
                s["maxItems"] = 0
            else:
                s[key] = _kept(x, f"{path}/{key}", sub, notes)
    if isinstance(s.get("pattern"), str):
        p = search_pattern(s["pattern"])
        if p is None:
            notes.append(f"{path}/pattern {s['pattern']!r} (an anchor inside it, which xgrammar ignores)")
        else:
            s["pattern"] = p
    if isinstance(s.get("patternProperties"), dict):
        rewritten = {}
        for key, sub in s["patternProperties"].items():
            p = search_pattern(key)
            if p is None:
                notes.append(f"{path}/patternProperties {key!r} (an anchor inside it, which xgrammar ignores)")
            rewritten[p if p is not None else key] = sub
        s["patternProperties"] = rewritten
    if "enum" in s or "const" in s:
        return _constants_filtered(s)
    if "type" not in s and _TYPED & s.keys() and not ({"anyOf", "oneOf", "allOf", "$ref"} & s.keys()):
        for k in _TYPED & s.keys():  # a $ref into a moved keyword follows it into its branch
            branch = next(i for i, t in enumerate(_SPLIT_TYPES) if k in _BY_TYPE.get(t, ()))
            ctx.moves.append((f"{path}/{k}", f"{path}/anyOf/{branch}/{k}"))
        return _split_by_type(s)
    return s


def _kept(x: Any, path: str, original: Any, notes: list[str]) -> Any:
    """A rewritten subschema where no rewrite of a value-less one exists: the original, noted."""
    if x is NEVER:
        notes.append(f"{path} (matches no value, which xgrammar cannot express here)")
        return original
    return x


def _never_properties(s: dict, path: str, notes: list[str], ctx: _Rewriter) -> bool:
    """Rewrite ``s["properties"]``; True when a required property matches no value (then
    ``s`` matches no object). An optional one is dropped: exact when additionalProperties
    is false, else the name becomes free (noted)."""
    required = set(s.get("required") or []) if isinstance(s.get("required"), list) else set()
    props = {}
    for name, v in s["properties"].items():
        x = _rewrite(v, f"{path}/properties/{name}", notes, ctx)
        if x is NEVER:
            if name in required:
                types = s.get("type")
                if types == "object" or types == ["object"]:
                    return True
                notes.append(f"{path}/properties/{name} (required, and matches no value)")
                props[name] = v
                continue
            if s.get("additionalProperties") is not False:
                notes.append(f"{path}/properties/{name} (matches no value; xgrammar cannot forbid the name)")
            continue
        props[name] = x
    s["properties"] = props
    return False


def search_pattern(pattern: str) -> str | None:
    """``pattern`` (found anywhere in a string, as JSON Schema reads it) as a regex that must
    match the whole string (as xgrammar reads it); None where an anchor stands elsewhere than
    at the start or end of a top-level alternative."""
    try:
        tokens = regex_tokens(pattern)
    except (AttributeError, IndexError):
        return None
    alternatives: list[list[str]] = [[]]
    depth = 0
    for t in tokens:
        if t.startswith("(") and not t.startswith("(?#"):  # a comment opens no group
            depth += 1
        elif t == ")":
            depth -= 1
        if t == "|" and depth == 0:
            alternatives.append([])
        else:
            alternatives[-1].append(t)
    out = []
    for alt in alternatives:
        start = bool(alt) and alt[0] == "^"
        end = len(alt) > start and alt[-1] == "$"
        body = alt[int(start) : len(alt) - int(end)]
        if any(t in ("^", "$") for t in body):
            return None
        out.append(("" if start else _ANY) + "(?:" + "".join(body) + ")" + ("" if end else _ANY))
    return "|".join(out)


def _constants_filtered(s: dict) -> Any:
    """Keep the enum/const values that satisfy the subschema's other keywords (xgrammar
    checks only the values). Keywords with references are left alone (not resolvable here)."""
    rules = {k: v for k, v in s.items() if k in _TYPED or k == "type"}
    if not rules or "$ref" in repr(rules):
        return s
    try:
        check = Draft202012Validator(rules, format_checker=Draft202012Validator.FORMAT_CHECKER)
        values = s["enum"] if isinstance(s.get("enum"), list) else []
        kept = [v for v in values if check.is_valid(v)]
        const_ok = "const" not in s or check.is_valid(s["const"])
    except Exception:  # noqa: BLE001 - a malformed keyword: let the compile say what is wrong
        return s
    if ("enum" in s and not kept) or not const_ok:
        return NEVER
    if "enum" in s:
        s["enum"] = kept
    return s


def _split_by_type(s: dict) -> dict:
    """An untyped subschema with type-specific keywords as an ``anyOf`` over the JSON types,
    each branch with its own keywords (the others stay outside)."""
    outer = {k: v for k, v in s.items() if k not in _TYPED}
    branches = []
    for t in _SPLIT_TYPES:
        branch: dict[str, Any] = {"type": t}
        branch.update({k: s[k] for k in _BY_TYPE.get(t, ()) if k in s})
        branches.append(branch)
    outer["anyOf"] = branches
    return outer


# xgrammar 0.2.9 spells a length-bounded string's characters like this: no escape, and raw
# control characters (other than CR and LF) allowed.
_LENGTH_CHARS = re.compile(r'^(\w+_characters) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.M)
_ESCAPE_RULE = 'basic_escape ::= (([\\"\\\\/bfnrt]) | ("u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]))'


def ebnf_with_string_escapes(ebnf: str) -> str | None:
    """xgrammar's EBNF for a schema, with its length-bounded string characters read as JSON
    does (an escape counts as one character, raw control characters are refused); None if
    the grammar has no such rule."""
    fixed, n = _LENGTH_CHARS.subn(r'\1 ::= (([^\\0-\\x1f\\"\\\\\\r\\n]) | ("\\\\" basic_escape))', ebnf)
    if not n:
        return None
    if not re.search(r"^basic_escape ::=", fixed, re.M):
        fixed += "\n" + _ESCAPE_RULE + "\n"
    return fixed
