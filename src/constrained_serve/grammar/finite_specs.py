"""Specs that can never be complete, refused at submit the same way by both backends.

A spec with no finite output (``{"properties": {"a": {"$ref": "#"}}, "required": ["a"]}``,
the Lark rule ``a: "x" a``) lets a model start an output it can never finish. The backends
differ on them: xgrammar's fast-forward follows the one infinite string and never returns,
llguidance accepts the spec and aborts mid-generation ("Too many items ... ff_tokens"). So
before either compiles, the spec itself is read and such specs are refused with one message:

- JSON Schema: a least fixed point over the subschemas reachable through ``$ref``: a
  subschema can end when one of its types can (a scalar always can; an object once each
  required property can; an array once its first ``minItems`` items can), an ``anyOf`` /
  ``oneOf`` when a branch can, an ``allOf`` when all can.
- Lark: lark's own grammar loader turns it into BNF; a rule can end once one of its
  expansions is all terminals and rules that can end.
- GBNF/EBNF: read by ``finite_output.rules_without_finite_text``.

Every reading is conservative: what it does not understand counts as able to end, and a
grammar it cannot read is not checked (the backend then decides), so a good spec is never
refused here.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ..errors import GrammarError
from ..params import OutputSpec
from .finite_output import rules_without_finite_text
from .schema_walk import resolve_local_ref

logger = logging.getLogger(__name__)

__all__ = ["check_can_end", "never_ending_parts"]

_SCALARS = frozenset({"string", "number", "integer", "boolean", "null"})
_ALL_TYPES = _SCALARS | {"object", "array"}


def check_can_end(spec: OutputSpec, backend: str) -> None:
    """Raise GrammarError if ``spec`` has no finite output, or parts an output can enter and
    never leave."""
    stuck = never_ending_parts(spec)
    if not stuck:
        return
    snippet = spec.text if len(spec.text) <= 200 else spec.text[:200] + "..."
    if stuck[0] in ("start", "root", "#"):
        reason = "the spec matches no finite text (it can never be complete)"
    else:
        what = "subschema(s)" if spec.is_json else "rule(s)"
        reason = f"{what} {', '.join(stuck[:5])} can never end: an output that entered one could never be complete"
    raise GrammarError(f"{backend} refuses {spec.kind} {snippet!r}: {reason}", backend=backend, reason=reason)


def never_ending_parts(spec: OutputSpec) -> list[str]:
    """The parts of ``spec`` (JSON pointers, rule names) that can never end, the whole spec
    ("#", "start", "root") first when it is one; [] when none is found or the spec is not read."""
    try:
        if spec.kind == "json_schema" and ("$ref" in spec.text or 'Ref"' in spec.text):
            return _schema_parts(json.loads(spec.text))
        if spec.kind == "lark":
            return _lark_rules(spec.text)
        if spec.kind == "ebnf":
            from .gbnf import gbnf_for_backend

            return rules_without_finite_text(gbnf_for_backend(spec.text, "xgrammar")) or []
    except (RecursionError, ValueError, TypeError, KeyError) as e:
        logger.debug("spec not checked for parts that can never end: %s", e)
    return []


# -- JSON Schema ----------------------------------------------------------------------------
def _schema_parts(root: Any) -> list[str]:
    refs: dict[str, Any] = {}  # every $ref target reachable from the root, by pointer

    def collect(s: Any) -> None:
        if isinstance(s, dict):
            ref = s.get("$ref")
            if isinstance(ref, str) and ref not in refs:
                refs[ref] = resolve_local_ref(root, ref)  # None: unknown, counts as able to end
                collect(refs[ref])
            for v in s.values():
                collect(v)
        elif isinstance(s, list):
            for v in s:
                collect(v)

    collect(root)
    can_end = {ref: False for ref in refs}  # least fixed point: nothing ends until shown to

    def ends(s: Any, depth: int = 0) -> bool:
        if depth > 200:
            return True
        if s is True or s is None or (isinstance(s, dict) and not s):
            return True
        if s is False:
            return False  # matches nothing at all (the backends' dead-end check reports the root)
        if not isinstance(s, dict):
            return True
        if "enum" in s or "const" in s:
            return True
        ref = s.get("$ref")
        if isinstance(ref, str) and not can_end.get(ref, True):
            return False
        if isinstance(s.get("allOf"), list) and not all(ends(b, depth + 1) for b in s["allOf"]):
            return False
        for key in ("anyOf", "oneOf"):
            if isinstance(s.get(key), list) and s[key] and not any(ends(b, depth + 1) for b in s[key]):
                return False
        types = s.get("type", sorted(_ALL_TYPES))
        types = [types] if isinstance(types, str) else types if isinstance(types, list) else sorted(_ALL_TYPES)
        for t in types:
            if t in _SCALARS:
                return True
            if t == "object":
                props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
                required = s.get("required") if isinstance(s.get("required"), list) else []
                if all(ends(props.get(name, True), depth + 1) for name in required):
                    return True
            if t == "array":
                n = s.get("minItems", 0)
                prefix = s.get("prefixItems") if isinstance(s.get("prefixItems"), list) else []
                items = s.get("items", True)
                if isinstance(items, list):  # draft-7 tuple form
                    prefix, items = items, s.get("additionalItems", True)
                needed = prefix[:n] + [items] * max(0, n - len(prefix)) if isinstance(n, int) else []
                if all(ends(x, depth + 1) for x in needed):
                    return True
        return False

    changed = True
    while changed:
        changed = False
        for ref, target in refs.items():
            if not can_end[ref] and ends(target):
                can_end[ref] = True
                changed = True
    stuck = sorted(ref for ref, ok in can_end.items() if not ok)
    if not ends(root):
        return ["#"] + [r for r in stuck if r != "#"]
    return stuck


# -- Lark -----------------------------------------------------------------------------------
def _lark_rules(text: str) -> list[str]:
    from lark.load_grammar import load_grammar

    try:
        grammar, _ = load_grammar(text, "<spec>", [], False)
        _, rules, _ = grammar.compile(["start"], set())
    except Exception as e:  # noqa: BLE001 - llguidance's Lark has syntax lark lacks: not checked
        logger.debug("Lark grammar not checked for rules that can never end: %s", e)
        return []
    by_origin: dict[str, list[list[Any]]] = {}
    for r in rules:
        by_origin.setdefault(r.origin.name, []).append(list(r.expansion))
    ending: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, expansions in by_origin.items():
            if name not in ending and any(all(sym.is_term or sym.name in ending for sym in exp) for exp in expansions):
                ending.add(name)
                changed = True
    reachable, todo = {"start"}, ["start"]
    while todo:
        for exp in by_origin.get(todo.pop(), []):
            for sym in exp:
                if not sym.is_term and sym.name not in reachable:
                    reachable.add(sym.name)
                    todo.append(sym.name)
    # lark names the rules it generates for repetitions "__start_star_0" and the like
    stuck = sorted((n for n in reachable - ending if n in by_origin), key=lambda n: (n != "start", n))
    return [n for n in stuck if not n.startswith("__")] or stuck[:1]
