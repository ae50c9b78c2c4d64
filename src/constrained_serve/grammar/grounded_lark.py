"""The llguidance grammar of a JSON Schema with grounded string fields (grounding.py).

llguidance's JSON Schema converter has no hook for a field whose values are spans of a text,
but its Lark front end has both halves: ``%json{...}`` embeds a schema as a non-terminal
(tools/grammar.py does the same for tool calls), and ``%regex {"substring_chunks": [...]}``
is its substring lexeme. So the schema is written as Lark where it leads to a grounded field
(those objects, arrays, ``anyOf`` branches and ``$ref`` targets become rules), every
subschema without one stays a ``%json`` embed, and each grounded value is one lexeme: a
quote, a substring of the source's JSON-escaped chunks, a quote.

What the rules keep of the schema, so that every output still validates against it (and
output_check.py checks it does): properties in schema order, required ones present,
optional ones skippable; objects closed (``additionalProperties: false``, which our specs
have unless the user opened them: an open object around a grounded field is refused);
``minItems``/``maxItems``; ``minLength``/``maxLength`` of a grounded field, by intersecting
its lexeme with a count of JSON characters, and its ``pattern``, by intersecting the lexeme
with the pattern (read as a search, as JSON Schema reads it) and with "no character JSON
escapes", so that the pattern sees the value itself, not its escapes (a grounded field with a
pattern never quotes a span holding a quote, a backslash or a control character; a nullable
one whose pattern no such span matches can only be null, and one marked
``"x-null-if-no-match"`` whose pattern one does match cannot be null); the spec's separators (compact, or free
whitespace). A schema shape around a grounded field that the rules do not express (``not``,
``if``, ``patternProperties``, ``prefixItems``, a ``$ref`` with siblings, ...) is refused
with a GrammarError naming the keyword, never approximated.

The substring lexeme is defined once per (source, unit) and shared by every grounded field:
its automaton is what compiling a long source costs (benchmarks/grounded.py).
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..errors import GrammarError
from ..params import Grounding, OutputSpec
from .grounding import GROUNDED_KEY, NULL_IF_NO_MATCH_KEY, chunks, escaped, grounded_unit, has_matching_span
from .lark_parts import json_embed, json_style, lark_literal
from .schema_walk import resolve_local_ref
from .xgrammar_rewrite import search_pattern

__all__ = ["grounded_grammar"]

# Keywords that say nothing about which JSON values a schema takes.
_ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$comment", "$schema", "$id", "$defs", "definitions", "deprecated"}
    | {"readOnly", "writeOnly", GROUNDED_KEY, NULL_IF_NO_MATCH_KEY}
)
_OBJECT_KEYS = _ANNOTATIONS | {"type", "properties", "required", "additionalProperties"}
_ARRAY_KEYS = _ANNOTATIONS | {"type", "items", "minItems", "maxItems"}
_STRING_KEYS = _ANNOTATIONS | {"type", "minLength", "maxLength", "pattern"}
# One character of a JSON string's body, as written: what minLength/maxLength count.
_JSON_CHAR = r'/([^"\\\x00-\x1f]|\\["\\\/bfnrt]|\\u[0-9a-fA-F]{4})/'
# A JSON string's body without escapes: there the pattern reads the value as it is.
_UNESCAPED = r'/[^"\\\x00-\x1f]*/'
_MAX_DEPTH = 64


def grounded_grammar(spec: OutputSpec) -> str:
    """The Lark grammar (llguidance's dialect) of ``spec``, a JSON Schema spec with a grounding."""
    if spec.grounding is None or spec.kind != "json_schema":
        raise ValueError("grounded_grammar needs a JSON Schema spec with a grounding")
    return _Builder(spec).grammar()


def _strip_marks(node: Any) -> Any:
    """A copy without ``x-grounded`` (an embedded %json has no grounded field, and the mark
    means nothing to llguidance's converter)."""
    if isinstance(node, dict):
        return {k: _strip_marks(v) for k, v in node.items() if k not in (GROUNDED_KEY, NULL_IF_NO_MATCH_KEY)}
    if isinstance(node, list):
        return [_strip_marks(v) for v in node]
    return node


def _mentions_ref(node: Any) -> bool:
    if isinstance(node, dict):
        return "$ref" in node or any(_mentions_ref(v) for v in node.values())
    if isinstance(node, list):
        return any(_mentions_ref(v) for v in node)
    return False


class _Builder:
    def __init__(self, spec: OutputSpec):
        self.root = json.loads(spec.text)
        self.grounding: Grounding = spec.grounding  # type: ignore[assignment]
        self.style = json_style(spec.whitespace, strict=spec.strict)
        self.whitespace = spec.whitespace
        self.rules: list[str] = []
        self.count = 0
        self.ref_rules: dict[str, str] = {}  # a $ref's rule (recursive schemas refer to it by name)
        self.spans: dict[str, str] = {}  # unit -> the terminal of its substring lexeme
        self.contains_memo: dict[int, bool] = {}

    def name(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    # -- does a subschema lead to a grounded field? ---------------------------------------
    def contains(self, node: Any, depth: int = 0, seen: frozenset[str] = frozenset()) -> bool:
        if not isinstance(node, dict) or depth > _MAX_DEPTH:
            return False
        key = id(node)
        if key in self.contains_memo:
            return self.contains_memo[key]
        found = False
        ref = node.get("$ref")
        if isinstance(ref, str) and ref not in seen:
            found = self.contains(resolve_local_ref(self.root, ref), depth + 1, seen | {ref})
        found = found or grounded_unit(node, self.grounding) is not None
        for k, v in node.items():
            if found:
                break
            if k in ("$defs", "definitions", "enum", "const", "default", "examples"):
                continue
            subs = v.values() if k in ("properties", "patternProperties", "dependentSchemas") else v
            subs = subs if isinstance(subs, (list, type({}.values()))) else [subs]
            found = any(self.contains(s, depth + 1, seen) for s in subs)
        self.contains_memo[key] = found
        return found

    # -- rules ----------------------------------------------------------------------------
    def grammar(self) -> str:
        top = self.rule(self.root, "$", 0)
        for name, p in (
            ("LBRACE", "{"),
            ("RBRACE", "}"),
            ("LBRACK", "["),
            ("RBRACK", "]"),
            ("COMMA", ","),
            ("COLON", ":"),
        ):
            if self.whitespace:  # JSON's whitespace around punctuation, as the %json parts allow it
                before = "[ \\t\\n\\r]*" if p not in "{[" else ""  # none before the first "{"
                after = "[ \\t\\n\\r]*" if p not in "}]" else ""  # nor after the last "}"
                self.rules.append(f"{name}: /{before}\\{p}{after}/")
            else:
                self.rules.append(f"{name}: {lark_literal(p)}")
        return f"start: {top}\n" + "\n".join(self.rules) + "\n"

    def refuse(self, where: str, what: str) -> GrammarError:
        return GrammarError(
            f"grounded fields: at {where} the schema uses {what}, which the grounded grammar does not express; "
            "mark fewer fields grounded or simplify the schema there",
            reason=f"grounded fields under {what}",
        )

    def rule(self, node: Any, where: str, depth: int) -> str:
        """The name of a rule matching the JSON values ``node`` takes."""
        if depth > _MAX_DEPTH:
            raise self.refuse(where, "nesting deeper than 64 levels")
        if not self.contains(node):
            return self.embed(node)
        ref = node.get("$ref")
        if isinstance(ref, str):
            extra = [k for k in node if k != "$ref" and k not in _ANNOTATIONS]
            if extra:
                raise self.refuse(where, f"$ref beside {', '.join(sorted(extra))}")
            if ref not in self.ref_rules:
                name = self.ref_rules[ref] = self.name("ref")
                self.rules.append(f"{name}: {self.rule(resolve_local_ref(self.root, ref), where, depth + 1)}")
            return self.ref_rules[ref]
        unit = grounded_unit(node, self.grounding)
        if unit is not None:
            return self.grounded(node, unit, where)
        for key in ("anyOf", "oneOf"):
            if key in node:
                extra = [k for k in node if k != key and k not in _ANNOTATIONS]
                if extra:
                    raise self.refuse(where, f"{key} beside {', '.join(sorted(extra))}")
                branches = [self.rule(b, where, depth + 1) for b in node[key]]
                return self.define("alt", " | ".join(branches))
        if "allOf" in node:
            if len(node["allOf"]) != 1 or any(k not in _ANNOTATIONS for k in node if k != "allOf"):
                raise self.refuse(where, "allOf")
            return self.rule(node["allOf"][0], where, depth + 1)
        types = node.get("type")
        if types == "object" or (types is None and "properties" in node):
            return self.object(node, where, depth)
        if types == "array" or (types is None and "items" in node):
            return self.array(node, where, depth)
        raise self.refuse(where, f"type {types!r} with {', '.join(sorted(node))}")

    def define(self, prefix: str, body: str) -> str:
        name = self.name(prefix)
        self.rules.append(f"{name}: {body}")
        return name

    def embed(self, node: Any) -> str:
        """A subschema without grounded fields: llguidance's own JSON Schema converter."""
        if node is True or node == {}:
            node = {}
        if not isinstance(node, dict):
            raise self.refuse("a subschema", f"the schema {node!r}")
        schema = _strip_marks(node)
        if _mentions_ref(schema):  # its $refs point into the root's definitions
            for key in ("$defs", "definitions"):
                if key in self.root and key not in schema:
                    schema[key] = _strip_marks(self.root[key])
        return self.define("json", json_embed(schema, self.style))

    def grounded(self, node: dict, unit: str, where: str) -> str:
        extra = [k for k in node if k not in _STRING_KEYS]
        if extra:
            raise self.refuse(where, f"a grounded string with {', '.join(sorted(extra))}")
        body = self.span(unit)
        lo, hi = node.get("minLength"), node.get("maxLength")
        if lo is not None or hi is not None:
            length = self.name("LEN")
            self.rules.append(f"{length}: {_JSON_CHAR}{{{int(lo or 0)},{'' if hi is None else int(hi)}}}")
            body = f"{body} & {length}"
        pattern = node.get("pattern")
        if pattern is not None:
            whole = search_pattern(pattern) if isinstance(pattern, str) else None
            if whole is None:
                raise self.refuse(where, f"the pattern {pattern!r} (an anchor inside it)")
            shape = self.name("PATTERN")
            slashed = re.sub(r"(\\.)|/", lambda m: m.group(1) or "\\/", whole)  # "/" ends a Lark regex
            self.rules.append(f"{shape}: /{slashed}/ & {_UNESCAPED}")
            body = f"{body} & {shape}"
        inner = self.name("SPAN")
        self.rules.append(f"{inner}: {body}")
        value = self.name("GROUNDED")
        self.rules.append(f'{value}: "\\"" {inner} "\\""')
        others = [
            t for t in ([node["type"]] if isinstance(node.get("type"), str) else node.get("type", [])) if t != "string"
        ]
        if node.get(NULL_IF_NO_MATCH_KEY) and self.matched(node, unit, where):
            others = [t for t in others if t != "null"]  # a span matches: it must take one
        if not others:
            return value
        rest = self.embed({"type": others})
        return self.define("nullable" if others == ["null"] else "typed", f"{value} | {rest}")

    def matched(self, node: dict, unit: str, where: str) -> bool:
        """``"x-null-if-no-match"``: does a span of the sources match the field's pattern?"""
        types = node.get("type")
        pattern, hi = node.get("pattern"), node.get("maxLength")
        if not isinstance(types, list) or "null" not in types or not isinstance(pattern, str) or hi is None:
            raise self.refuse(
                where, f'{NULL_IF_NO_MATCH_KEY} without "type": ["string", "null"], a pattern and a maxLength'
            )
        return has_matching_span(self.grounding.sources, unit, pattern, int(node.get("minLength", 0)), int(hi))

    def span(self, unit: str) -> str:
        """The substring lexeme of the sources in ``unit`` (one per unit, shared by every field)."""
        if unit not in self.spans:
            parts = []
            for source in self.grounding.sources:
                pieces = [escaped(c) for c in chunks(source, unit)]
                parts.append("%regex " + json.dumps({"substring_chunks": pieces}, ensure_ascii=False))
            name = self.spans[unit] = f"SOURCE_{unit.upper()}"
            self.rules.append(f"{name}: " + (" | ".join(parts) if parts else '""'))
        return self.spans[unit]

    def object(self, node: dict, where: str, depth: int) -> str:
        extra = [k for k in node if k not in _OBJECT_KEYS]
        if extra:
            raise self.refuse(where, ", ".join(sorted(extra)))
        if node.get("additionalProperties", True) is not False:
            raise self.refuse(where, "an object open to other keys (additionalProperties)")
        props = node.get("properties") or {}
        required = set(node.get("required") or [])
        keys = list(props)
        missing = [k for k in required if k not in props]
        if missing:  # closed_objects.py declares required keys; a schema that does not is unsatisfiable
            raise self.refuse(where, f"required keys without properties ({', '.join(missing)})")
        members = [
            self.define(
                "member",
                f"{lark_literal(json.dumps(k, ensure_ascii=False))} COLON "
                f"{self.rule(props[k], f'{where}.{k}', depth + 1)}",
            )
            for k in keys
        ]
        n = len(keys)
        optional_from = [all(k not in required for k in keys[i:]) for i in range(n + 1)]

        # tail[i]: ", member_j ..." for the members j >= i, skipping only optional ones.
        tails: dict[int, str] = {}
        for i in range(n - 1, 0, -1):  # tail[0] is never used: the first member has no comma
            alts = []
            for j in range(i, n):
                rest = f" {tails[j + 1]}{'?' if optional_from[j + 1] else ''}" if j + 1 < n else ""
                alts.append(f"COMMA {members[j]}{rest}")
                if keys[j] in required:
                    break
            tails[i] = self.define("tail", " | ".join(alts))
        firsts = []
        for j in range(n):
            rest = f" {tails[j + 1]}{'?' if optional_from[j + 1] else ''}" if j + 1 < n else ""
            firsts.append(f"{members[j]}{rest}")
            if keys[j] in required:
                break
        alts = [f"LBRACE ({' | '.join(firsts)}) RBRACE"] if firsts else []
        if optional_from[0]:
            alts.append("LBRACE RBRACE")
        return self.define("object", " | ".join(alts))

    def array(self, node: dict, where: str, depth: int) -> str:
        extra = [k for k in node if k not in _ARRAY_KEYS]
        if extra:
            raise self.refuse(where, ", ".join(sorted(extra)))
        item = self.rule(node.get("items", {}), f"{where}[]", depth + 1)
        lo, hi = int(node.get("minItems", 0)), node.get("maxItems")
        if hi is not None and int(hi) < max(lo, 1):
            if int(hi) < lo:
                raise self.refuse(where, "maxItems below minItems")
            return self.define("array", "LBRACK RBRACK")  # maxItems 0
        more = f"(COMMA {item}){{{max(lo - 1, 0)},{'' if hi is None else int(hi) - 1}}}"
        alts = [f"LBRACK {item} {more} RBRACK"]
        if lo == 0:
            alts.append("LBRACK RBRACK")
        return self.define("array", " | ".join(alts))
