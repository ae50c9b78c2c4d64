"""What xgrammar (checked on 0.2.9) would silently drop or read differently, found before
compiling: JSON Schema keywords it does not enforce, and regex syntax it reads otherwise than
Python and llguidance do (brought to their meaning, or refused). What xgrammar would only
read more loosely is refused under ``strict=True`` and accepted, with a warning, under
``strict=False``. Every case here was seen to accept text that the spec does not match.
"""

from __future__ import annotations

import json
import re
from typing import Any

from jsonschema import Draft202012Validator

from ..errors import GrammarError
from .regex_scan import regex_tokens
from .schema_walk import SCHEMA_NAME_MAPS, SUBSCHEMA_LISTS, SUBSCHEMA_VALUES, follow_local_refs, resolve_local_ref

__all__ = ["unsupported_schema_features", "xgrammar_regex"]

# Validation keywords xgrammar's JSON Schema converter does not enforce (checked on 0.2.9).
_IGNORED_KEYWORDS = frozenset(
    {
        "not",
        "if",
        "then",
        "else",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "unevaluatedProperties",
        "unevaluatedItems",
        "contains",
        "minContains",
        "maxContains",
        "$dynamicRef",
        "$recursiveRef",
        "additionalItems",
    }
)
_FORMATS = frozenset(
    {
        "email",
        "date",
        "time",
        "date-time",
        "duration",
        "ipv4",
        "ipv6",
        "hostname",
        "uuid",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
    }
)
# Lookaround and backreferences: a regex engine without them would match something else.
# \A \Z \z \G: xgrammar reads them as the letters A, Z, z, G.
_UNSUPPORTED_REGEX = re.compile(r"\(\?[=!<]|(?<!\\)(?:\\\\)*\\([1-9]|k<|[AZzG])")
# Keywords that only constrain strings or numbers: xgrammar drops them from a schema without
# "type" (which it reads as any value), and next to "enum"/"const" (it checks only those).
_SCALAR_KEYWORDS = frozenset(
    {
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "minLength",
        "maxLength",
        "pattern",
        "format",
    }
)


def unsupported_schema_features(
    schema: Any, path: str = "#", root: Any = None, seen: set[str] | None = None
) -> list[str]:
    """Where ``schema`` uses a feature xgrammar would silently drop or approximate. Local
    ``$ref``s are followed (each target once), so subschemas kept outside the usual places
    (``#/definitions/a/b``) are checked too."""
    found: list[str] = []
    if not isinstance(schema, dict):
        return found
    root = schema if root is None else root
    seen = set() if seen is None else seen
    for key in _IGNORED_KEYWORDS & schema.keys():
        found.append(f"{path}/{key}")
    if schema.get("uniqueItems") is True:
        found.append(f"{path}/uniqueItems")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        found.append(f"{path}/allOf (merged approximately)")
    one_of = schema.get("oneOf")
    if isinstance(one_of, list) and len(one_of) > 1 and not _one_of_is_exact(one_of, root):
        found.append(f"{path}/oneOf (treated as anyOf)")
    # Combinations xgrammar 0.2.9 logs as "ignoring ..." (to stderr, which we cannot read).
    if "multipleOf" in schema:
        if schema.get("type") != "integer":
            found.append(f"{path}/multipleOf (only enforced for integers)")
        elif {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"} & schema.keys():
            found.append(f"{path}/multipleOf (ignored together with a range)")
    if "format" in schema and "pattern" in schema:
        found.append(f"{path}/pattern (ignored next to format)")
    if ("format" in schema or "pattern" in schema) and ({"minLength", "maxLength"} & schema.keys()):
        found.append(f"{path}/minLength/maxLength (ignored with format or pattern)")
    scalar = sorted(_SCALAR_KEYWORDS & schema.keys())
    if scalar and ("enum" in schema or "const" in schema):
        if not _constants_obey(schema, scalar):
            found.append(f"{path}/{'/'.join(scalar)} (only the enum/const is checked)")
    elif scalar and "type" not in schema:
        found.append(f'{path}/{"/".join(scalar)} (ignored without "type")')
    required = schema.get("required")
    types = schema.get("type", "object")
    if isinstance(required, list) and ("object" in types if isinstance(types, list) else types == "object"):
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        missing = [str(n) for n in required if n not in props]
        if missing:
            found.append(f"{path}/required {missing} (names not in properties are not required)")
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        found.append(f"{path}/$ref {ref!r} (not local)")
    elif isinstance(ref, str) and ref not in seen:
        seen.add(ref)
        found += unsupported_schema_features(resolve_local_ref(root, ref), ref, root, seen)
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt not in _FORMATS:
        found.append(f"{path}/format {fmt!r}")
    pat = schema.get("pattern")
    # \W, \D and negated classes with \w/\d are fine here, unlike in a regex= spec: a JSON
    # Schema pattern is ECMA-262, whose \w and \d are ASCII, so their complements take "é"
    # and "٣" as xgrammar's do (seen on 0.2.9, the same as llguidance; see xgrammar_regex).
    if isinstance(pat, str) and _UNSUPPORTED_REGEX.search(pat):
        found.append(f"{path}/pattern {pat!r}")
    if isinstance(schema.get("patternProperties"), dict) and schema.get("properties"):
        found.append(f"{path}/patternProperties (ignored next to properties)")
    for key in sorted(SCHEMA_NAME_MAPS):
        sub = schema.get(key)
        if isinstance(sub, dict):
            for name, s in sub.items():
                found += unsupported_schema_features(s, f"{path}/{key}/{name}", root, seen)
    for key in SUBSCHEMA_LISTS:
        sub = schema.get(key)
        if isinstance(sub, list):
            for i, s in enumerate(sub):
                found += unsupported_schema_features(s, f"{path}/{key}/{i}", root, seen)
    for key in SUBSCHEMA_VALUES:
        sub = schema.get(key)
        if isinstance(sub, list):  # draft-7 tuple "items"
            for i, s in enumerate(sub):
                found += unsupported_schema_features(s, f"{path}/{key}/{i}", root, seen)
        else:
            found += unsupported_schema_features(sub, f"{path}/{key}", root, seen)
    return found


def _constants_obey(schema: dict, keywords: list[str]) -> bool:
    """Every value of the schema's ``enum``/``const`` satisfies ``keywords`` (and ``type``):
    then checking only the enum, as xgrammar does, is exact."""
    values = schema["enum"] if isinstance(schema.get("enum"), list) else []
    values = values + ([schema["const"]] if "const" in schema else [])
    rules = {k: schema[k] for k in (*keywords, "type") if k in schema}
    try:
        check = Draft202012Validator(rules, format_checker=Draft202012Validator.FORMAT_CHECKER)
        return all(check.is_valid(v) for v in values)
    except Exception:  # noqa: BLE001 - a malformed keyword: let the compile say what is wrong
        return False


def _one_of_is_exact(branches: list, root: Any) -> bool:
    """xgrammar treats oneOf as anyOf, which is exact when no value can match two branches:
    branches of distinct JSON types (every integer is also a number, so those two overlap),
    or objects told apart by a required property that holds a different constant in each
    (Pydantic's discriminated unions: ``{"kind": {"const": "cat"}}`` vs ``"dog"``)."""
    resolved = [_deref(b, root) for b in branches]
    if not all(isinstance(b, dict) for b in resolved):
        return False
    types = [b.get("type") for b in resolved]
    if (
        all(isinstance(t, str) for t in types)
        and len(set(types)) == len(types)
        and not {"integer", "number"} <= set(types)
    ):
        return True
    # Without "type": "object" a branch also matches every non-object value.
    if any(t != "object" or not isinstance(b.get("required"), list) for t, b in zip(types, resolved)):
        return False
    for name in sorted(set.intersection(*(set(map(str, b["required"])) for b in resolved))):
        values = [_constant(_deref((b.get("properties") or {}).get(name), root)) for b in resolved]
        if None not in values and len(set(values)) == len(values):
            return True
    return False


def _deref(schema: Any, root: Any) -> Any:
    """A branch that is only a local ``$ref`` stands for its target."""
    return follow_local_refs(schema, root) if isinstance(schema, dict) and set(schema) == {"$ref"} else schema


def _constant(schema: Any) -> str | None:
    """The JSON text of the one value a ``const`` or one-item ``enum`` allows, else None."""
    if isinstance(schema, dict):
        if "const" in schema:
            return json.dumps(schema["const"], sort_keys=True)
        if isinstance(schema.get("enum"), list) and len(schema["enum"]) == 1:
            return json.dumps(schema["enum"][0], sort_keys=True)
    return None


def xgrammar_regex(pattern: str, strict: bool = True, approximations: list[str] | None = None) -> str:
    """``pattern`` as xgrammar must read it to mean what it means to Python's ``re`` and to
    llguidance (a whole-text match): a ``.`` outside a class becomes ``[^\\n]`` (xgrammar's
    ``.`` matches a newline too); ``\\A`` and ``\\Z``/``\\z`` become ``^`` and ``$``. xgrammar
    ignores anchors, which is exact only where they stand at the edges of the text (``^a$|^b$``,
    ``(^a|^b)c``). Where xgrammar's reading is only looser than Python's, the pattern is refused
    under ``strict=True`` and, under ``strict=False``, kept as xgrammar reads it with a line
    added to ``approximations``: an anchor anywhere else (``a^b``, which then matched "ab"), and
    ``\\W``, ``\\D`` and negated classes holding ``\\w`` or ``\\d`` (xgrammar's ``\\w``/``\\d`` are
    ASCII-only, so their complement takes "é" and "٣"; its ``\\w``/``\\d`` themselves are merely
    stricter than Python's). ``\\G``, inline flags and a class starting ``[\\^-`` are refused
    either way: xgrammar would read them as something else, not as more.

    (A JSON Schema ``pattern`` does not come here: it means ECMA-262's ASCII ``\\w``/``\\d``,
    which is what xgrammar reads.)"""

    def approximate(reason: str) -> None:
        if strict:
            raise _regex_error(pattern, reason + "; strict=False accepts xgrammar's looser reading")
        if approximations is not None:
            approximations.append(reason)

    tokens = regex_tokens(pattern)
    inline_flags = [t for t in tokens if t.startswith("(?") and t != "(?:" and not t.startswith(("(?P<", "(?#"))]
    if "\\G" in tokens or inline_flags:
        raise _regex_error(pattern, "xgrammar has no \\G and no inline flags")
    if any(_ascii_class_negated(t) for t in tokens):
        approximate(
            "\\W, \\D or a negated class with \\w or \\d: xgrammar reads \\w and \\d as ASCII, so their "
            "complement takes the letters and digits of other scripts (é, ٣) that Python's re refuses; "
            "spell the class out or use llguidance"
        )
    tokens = [
        "^"
        if t == "\\A"
        else "$"
        if t in ("\\Z", "\\z")
        else "[^\\n]"
        if t == "."
        else _class(t, pattern)
        if t.startswith("[")
        else t
        for t in tokens
    ]
    if _repeated_anchor(tokens):
        approximate("a repeated group holding an anchor, which xgrammar ignores")
    opens = [t.startswith("(") and not t.startswith("(?#") for t in tokens]  # a comment opens nothing
    closes = [t == ")" for t in tokens]
    for anchor, seq, is_open, is_close in (
        ("^", tokens, opens, closes),
        ("$", tokens[::-1], closes[::-1], opens[::-1]),
    ):
        if not _anchors_at_edge(seq, anchor, is_open, is_close):
            approximate(f"an anchor {anchor!r} inside the text, which xgrammar ignores")
    return "".join(tokens)


def _ascii_class_negated(token: str) -> bool:
    """``\\W``/``\\D``, alone or in a class, or ``\\w``/``\\d`` in a negated class."""
    if token in ("\\W", "\\D"):
        return True
    if not token.startswith("["):
        return False
    escapes = re.findall(r"\\.", token)  # pairs left to right: "\\\\W" is a backslash, then W
    return any(e in ("\\W", "\\D") or (token.startswith("[^") and e in ("\\w", "\\d")) for e in escapes)


def _class(token: str, pattern: str) -> str:
    """xgrammar reads an escaped ``\\^`` first in a class as negation (``[\\^x]`` took "1"):
    move it to the end, where it is a plain character."""
    head = "[^" if token.startswith("[^") else "["
    body = token[len(head) : -1]
    if not body.startswith("\\^"):
        return token
    rest = body[2:]
    if rest.startswith("-") or rest.endswith("-"):  # a range from "^", or a dangling "-"
        raise _regex_error(pattern, f"the class {token}, which xgrammar reads as a negated class")
    return f"{head}{rest}\\^]" if rest or head == "[^" else "\\^"


def _repeated_anchor(tokens: list[str]) -> bool:
    """A group with ``^``/``$`` inside under a quantifier: ``(^a)+`` matches only "a" in Python
    (the anchor fails on the second round); xgrammar, ignoring it, takes "aa"."""
    stack: list[bool] = []  # per open group: holds an anchor
    for t, nxt in zip(tokens, tokens[1:] + [""]):
        if t.startswith("("):
            stack.append(False)
        elif t == ")" and stack:
            anchored = stack.pop()
            if anchored and nxt[:1] in ("*", "+", "{"):  # "?" runs the group at most once
                return True
            if stack:
                stack[-1] = stack[-1] or anchored
        elif t in ("^", "$") and stack:
            stack[-1] = True
    return False


def _anchors_at_edge(tokens: list[str], anchor: str, is_open: list[bool], is_close: list[bool]) -> bool:
    """Every ``anchor`` comes before anything that consumes text, counting from the start
    of the pattern through group openings and alternatives (for "$", run on the reversed
    tokens with the roles of "(" and ")" swapped)."""
    at_edge, stack = True, []  # stack: whether each open group began at the edge
    for t, opening, closing in zip(tokens, is_open, is_close):
        if opening:
            stack.append(at_edge)
        elif closing:
            if stack:
                stack.pop()
            at_edge = False
        elif t == "|":
            at_edge = stack[-1] if stack else True
        elif t == anchor:
            if not at_edge:
                return False
        elif t not in ("^", "$"):  # the other anchor consumes nothing either
            at_edge = False
    return True


def _regex_error(pattern: str, reason: str) -> GrammarError:
    return GrammarError(
        f"xgrammar cannot compile regex {pattern!r} as Python reads it: {reason} "
        "(the llguidance backend reads it as Python does)",
        backend="xgrammar",
        reason=reason,
    )
