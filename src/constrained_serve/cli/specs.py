"""Turn the CLI's --schema / --regex / --grammar flags into Engine keyword arguments.

Every problem found here (missing file, bad JSON, invalid schema, unimportable model)
raises ``SetupError`` with a message meant for the terminal, before any model is loaded.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any


class SetupError(Exception):
    """A bad flag or file, reported before any row is processed (exit status 2)."""


@dataclass
class OutputSpecArgs:
    """What the engine gets (``kwargs``) and how to describe it to the model."""

    kwargs: dict[str, Any] = field(default_factory=dict)
    json_output: bool = True
    schema_json: dict[str, Any] | None = None  # for the default instructions
    label: str = "any JSON object"


_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def load_schema(ref: str) -> tuple[Any, dict[str, Any], str]:
    """A JSON Schema file or ``package.module:Model``; returns (engine value, JSON schema, label)."""
    if os.path.exists(ref):
        try:
            with open(ref, encoding="utf-8") as f:
                schema = json.load(f)
        except (OSError, UnicodeDecodeError) as e:
            raise SetupError(f"cannot read schema file {ref}: {e}") from None
        except json.JSONDecodeError as e:
            raise SetupError(f"schema file {ref} is not valid JSON: {e}") from None
        _check_json_schema(schema, ref)
        return schema, schema, f"JSON Schema {os.path.basename(ref)}"
    if _IMPORT_PATH.match(ref):
        model = _import_object(ref)
        try:
            from pydantic import BaseModel
        except ImportError:  # pragma: no cover - pydantic is a dependency
            raise SetupError("--schema module:Model needs pydantic") from None
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise SetupError(f"--schema {ref} is {model!r}, not a Pydantic model class")
        return model, model.model_json_schema(), f"Pydantic model {model.__name__}"
    raise SetupError(f"--schema {ref}: no such file (and not a module:Model import path)")


def _check_json_schema(schema: Any, where: str) -> None:
    if not isinstance(schema, (dict, bool)):
        raise SetupError(f"{where}: a JSON Schema must be an object, got {type(schema).__name__}")
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        path = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise SetupError(f"{where} is not a valid JSON Schema at {path}: {e.message}") from None


def _import_object(ref: str) -> Any:
    module_name, _, attr = ref.partition(":")
    # Like `python -m`, let a module in the current directory be found.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise SetupError(f"--schema {ref}: cannot import {module_name}: {e}") from None
    except Exception as e:  # an error while running the user's module
        raise SetupError(f"--schema {ref}: importing {module_name} failed: {type(e).__name__}: {e}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise SetupError(f"--schema {ref}: {module_name} has no attribute {attr}") from None
    return obj


def _read_text(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise SetupError(f"cannot read {flag} file {path}: {e}") from None


def build_spec(
    schema: str | None, regex: str | None, grammar: str | None, grammar_syntax: str = "lark"
) -> OutputSpecArgs:
    """At most one of the three; none means "any JSON object"."""
    given = [n for n, v in (("--schema", schema), ("--regex", regex), ("--grammar", grammar)) if v is not None]
    if len(given) > 1:
        raise SetupError(f"give only one of {', '.join(given)}")
    if schema is not None:
        value, schema_json, label = load_schema(schema)
        return OutputSpecArgs({"schema": value}, True, schema_json, label)
    if regex is not None:
        # Not checked with Python's `re`: the backends use Rust-style syntax (\p{L}, ...),
        # so the engine's GrammarError, raised before any model work, has the last word.
        if not regex:
            raise SetupError("--regex is empty")
        return OutputSpecArgs({"regex": regex}, False, None, f"regex {regex}")
    if grammar is not None:
        text = _read_text(grammar, "--grammar")
        if not text.strip():
            raise SetupError(f"--grammar file {grammar} is empty")
        kwargs = {"grammar": text, "grammar_syntax": grammar_syntax}
        return OutputSpecArgs(kwargs, False, None, f"{grammar_syntax} grammar {os.path.basename(grammar)}")
    any_object: dict[str, Any] = {"type": "object"}
    return OutputSpecArgs({"schema": any_object}, True, any_object, "any JSON object")


def _describe_field(prop: Any) -> str | None:
    """Plain words for one simple property, or None when it is not simple."""
    if not isinstance(prop, dict):
        return None
    note = f" ({prop['description']})" if isinstance(prop.get("description"), str) else ""
    if "enum" in prop and all(isinstance(v, (str, int, float, bool)) for v in prop["enum"]):
        return "one of " + ", ".join(json.dumps(v) for v in prop["enum"]) + note
    kind = prop.get("type")
    if kind == "string":
        return "text" + note
    if kind in ("integer", "number"):
        lo, hi = prop.get("minimum"), prop.get("maximum")
        word = "a whole number" if kind == "integer" else "a number"
        if lo is not None and hi is not None:
            word += f" from {lo} to {hi}"
        return word + note
    if kind == "boolean":
        return "true or false" + note
    if kind == "array":
        inner = _describe_field(prop.get("items", {}))
        return f"a list, each {inner}{note}" if inner else None
    return None


def describe_schema(schema: Any) -> str:
    """The schema in words for a flat object (what small models follow best: dumped JSON
    Schema keywords tend to leak into the values), else the compact JSON Schema itself."""
    props = schema.get("properties") if isinstance(schema, dict) else None
    if isinstance(props, dict) and props:
        lines = []
        for name, prop in props.items():
            words = _describe_field(prop)
            if words is None:
                break
            lines.append(f"- {name}: {words}")
        else:
            return "a JSON object with these fields:\n" + "\n".join(lines)
    return "JSON that follows this JSON Schema:\n" + json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def default_instructions(spec: OutputSpecArgs) -> str | None:
    """The system message used when --instructions is not given.

    The grammar already forces the shape; telling the model what the fields mean (names,
    allowed values, descriptions) is what makes the *values* right. It is one shared
    prefix for every row, so the prefix cache pays for it once.
    """
    if spec.schema_json is None or spec.schema_json == {"type": "object"}:
        return "Extract the key facts from the user's text as a JSON object." if spec.schema_json else None
    return f"Extract the facts stated in the user's text as {describe_schema(spec.schema_json)}"
