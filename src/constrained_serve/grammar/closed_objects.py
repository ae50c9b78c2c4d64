"""Closed objects: a JSON Schema object that does not say which extra keys it takes gets none.

JSON Schema leaves an object open unless it says ``additionalProperties: false``; Pydantic's
``model_json_schema()`` and most hand-written schemas never say it, so a model constrained
by them invents keys. Like OpenAI's strict mode, xgrammar's default and Outlines, every
object subschema that declares ``properties`` and says nothing about extras gets
``additionalProperties: false``, before either backend sees the schema (so both apply the
same rule). ``make_output_spec(json_open_objects=True)`` keeps the literal
meaning.

What is left alone:

- An object that says ``additionalProperties`` (``true`` or a schema), ``patternProperties``
  or ``unevaluatedProperties``: the user said what extras it takes.
- An object without ``properties`` (``{"type": "object"}``, a free-form dict, an object
  that only lists ``required`` keys): closing it would allow only ``{}`` (or only the
  required keys).
- Whatever is inside ``not`` or ``if`` (closing there would widen what they accept), and
  the top level of ``dependentSchemas`` values.

A required key counts as declared (it is added to ``properties`` as ``{}``), so a schema
that requires a key it does not describe stays satisfiable.

Composition. An object whose keys come from several places (its own ``properties`` and the
branches of its ``allOf``/``anyOf``/``oneOf``/``then``/``else``, or two ``allOf`` branches)
would be unsatisfiable if each part were closed to its own keys (``allOf: [{a}, {b}]``
closed part by part accepts neither ``a`` nor ``b``). There the object that composes is
closed with the union of the keys of all its parts (added to its ``properties`` as ``{}``;
its own schemas for them are kept), its ``allOf`` branches stay open at their top level,
and each ``anyOf``/``oneOf``/``then``/``else`` branch that declares properties is closed
to its own keys plus the composing object's own and ``allOf`` keys. A ``$ref`` branch whose
target declares properties is replaced there by a copy of the target, so that the target
itself stays closed where it is used alone.
"""

from __future__ import annotations

import copy
from typing import Any

from .schema_walk import SCHEMA_NAME_MAPS, SUBSCHEMA_LISTS, SUBSCHEMA_VALUES, resolve_local_ref

__all__ = ["close_objects"]

# Keywords with which an object says what extra keys it takes.
_DECIDES = ("additionalProperties", "patternProperties", "unevaluatedProperties")
# In-place applicators whose branches describe the same object as their parent.
_BRANCH_LISTS = ("allOf", "anyOf", "oneOf")
_BRANCH_VALUES = ("then", "else")
# Not entered: closing inside them would widen what the schema accepts.
_SKIP = frozenset({"not", "if"})
_MAX_DEPTH = 24  # $ref chains followed to collect names or to inline a branch


def close_objects(schema: Any) -> Any:
    """``schema`` (a fresh copy the caller owns: it is changed in place) with every object
    that declares its keys and says nothing about extras closed; see the module docstring."""
    if isinstance(schema, dict):
        _Closer(schema).visit(schema, open_top=False, depth=0)
    return schema


class _Closer:
    def __init__(self, root: dict) -> None:
        # $refs are followed in the schema as given: a target already closed in place could
        # not be inlined open (see _compose).
        self.root = copy.deepcopy(root)

    # -- what a (sub)schema says about the keys of the object it describes ----------------
    def _target(self, node: Any, depth: int = 0) -> Any:
        """``node`` with a pure local ``$ref`` followed (a chain of them)."""
        while isinstance(node, dict) and isinstance(node.get("$ref"), str) and depth < _MAX_DEPTH:
            target = resolve_local_ref(self.root, node["$ref"])
            if target is None or target is node:
                break
            node, depth = target, depth + 1
        return node

    def _branches(self, node: dict) -> list[tuple[str, int | None, Any]]:
        out: list[tuple[str, int | None, Any]] = []
        for key in _BRANCH_LISTS:
            subs = node.get(key)
            if isinstance(subs, list):
                out.extend((key, i, b) for i, b in enumerate(subs))
        for key in _BRANCH_VALUES:
            if key in node:
                out.append((key, None, node[key]))
        return out

    def _declares(self, node: Any, depth: int = 0) -> bool:
        """Does it (or a branch of it) declare ``properties``?"""
        node = self._target(node)
        if not isinstance(node, dict) or depth > _MAX_DEPTH:
            return False
        if isinstance(node.get("properties"), dict):
            return True
        return any(self._declares(b, depth + 1) for _, _, b in self._branches(node))

    def _names(self, node: Any, depth: int = 0) -> list[str]:
        """The keys it (and its branches) declares or requires, in order."""
        node = self._target(node)
        if not isinstance(node, dict) or depth > _MAX_DEPTH:
            return []
        names = _own_names(node)
        for _, _, b in self._branches(node):
            names.extend(self._names(b, depth + 1))
        return list(dict.fromkeys(names))

    # -- the walk -------------------------------------------------------------------------
    def visit(self, node: Any, open_top: bool, depth: int) -> None:
        """Close ``node`` (unless ``open_top``: it is one part of a composed object) and,
        below it, every object subschema."""
        if not isinstance(node, dict):
            return
        decides = any(k in node for k in _DECIDES)
        branches = self._branches(node)
        in_all = sum(self._declares(b) for k, _, b in branches if k == "allOf")
        in_alternatives = sum(self._declares(b) for k, _, b in branches if k != "allOf")
        # Keys from several places; alternatives alone (anyOf: [{a}, {b}]) each close themselves.
        own = isinstance(node.get("properties"), dict) or decides
        if (in_all or in_alternatives) and (own or in_all >= 2 or (in_all and in_alternatives)):
            self._compose(node, branches, open_top or decides, depth)
        else:
            if not open_top and not decides and isinstance(node.get("properties"), dict):
                _close(node, _own_names(node))
            for _, _, b in branches:
                self.visit(b, open_top=False, depth=depth + 1)
        self._visit_children(node, depth)

    def _compose(self, node: dict, branches: list[tuple[str, int | None, Any]], open_top: bool, depth: int) -> None:
        # A $ref branch that declares properties becomes a copy of its target here.
        for key, i, b in branches:
            if isinstance(b, dict) and "$ref" in b and self._declares(b) and depth < _MAX_DEPTH:
                target = self._target(b)
                if isinstance(target, dict) and target is not b:
                    inlined = copy.deepcopy(target)
                    inlined.update({k: v for k, v in b.items() if k != "$ref"})
                    if i is None:
                        node[key] = inlined
                    else:
                        node[key][i] = inlined
        branches = self._branches(node)
        if open_top:  # the parts stay open; whoever composes this object closes it
            for _, _, b in branches:
                self.visit(b, open_top=True, depth=depth + 1)
            return
        base = _own_names(node)
        for key, _, b in branches:
            if key == "allOf":
                base.extend(self._names(b))
        base = list(dict.fromkeys(base))
        every = list(base)
        for key, _, b in branches:
            if key != "allOf":
                every.extend(self._names(b))
        _close(node, list(dict.fromkeys(every)))
        for key, _, b in branches:
            if key == "allOf" or not self._declares(b):
                self.visit(b, open_top=True, depth=depth + 1)
            else:  # an alternative: closed to its keys and those every alternative shares
                if isinstance(b, dict) and not any(k in b for k in _DECIDES) and isinstance(b.get("properties"), dict):
                    _add_names(b, base)
                self.visit(b, open_top=False, depth=depth + 1)

    def _visit_children(self, node: dict, depth: int) -> None:
        for key, value in node.items():
            if key in _SKIP or key in _BRANCH_LISTS or key in _BRANCH_VALUES:
                continue
            if key in SCHEMA_NAME_MAPS and isinstance(value, dict):
                for sub in value.values():
                    self.visit(sub, open_top=key == "dependentSchemas", depth=depth + 1)
            elif key in SUBSCHEMA_LISTS and isinstance(value, list):
                for sub in value:
                    self.visit(sub, open_top=False, depth=depth + 1)
            elif key in SUBSCHEMA_VALUES:
                for sub in value if isinstance(value, list) else [value]:  # draft-4 tuple "items"
                    self.visit(sub, open_top=False, depth=depth + 1)


def _own_names(node: dict) -> list[str]:
    names: list[str] = []
    props = node.get("properties")
    if isinstance(props, dict):
        names.extend(str(k) for k in props)
    required = node.get("required")
    if isinstance(required, list):
        names.extend(r for r in required if isinstance(r, str))
    return list(dict.fromkeys(names))


def _add_names(node: dict, names: list[str]) -> None:
    props = node.get("properties")
    if not isinstance(props, dict):
        props = node["properties"] = {}
    for n in names:
        props.setdefault(n, {})


def _close(node: dict, names: list[str]) -> None:
    _add_names(node, names)
    node["additionalProperties"] = False
