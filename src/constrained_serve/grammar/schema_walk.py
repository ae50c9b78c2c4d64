"""How a JSON Schema nests: the keywords that hold subschemas, and local ``$ref`` pointers.

Shared by every module that walks a schema (spec.py's canonical form, closed_objects.py,
xgrammar_gaps.py, xgrammar_rewrite.py, finite_specs.py), so each walks the same keywords.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

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
