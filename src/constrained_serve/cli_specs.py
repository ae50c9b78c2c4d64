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


def build_spec(schema: str | None, regex: str | None, grammar: str | None, grammar_syntax: str = "lark") -> OutputSpecArgs:
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


def default_instructions(spec: OutputSpecArgs) -> str | None:
    """The system message used when --instructions is not given.

    The grammar already forces the shape; telling the model the schema too (field names,
    enums, descriptions) is what makes the *values* right. It is one shared prefix for
    every row, so the prefix cache pays for it once.
    """
    if spec.schema_json is None:
        return None
    schema = json.dumps(spec.schema_json, separators=(",", ":"), ensure_ascii=False)
    return (
        "Extract structured data from the user's text. Reply with one JSON value that "
        f"follows this JSON Schema, using only facts stated in the text:\n{schema}"
    )
