"""Paths of the repository and the environment of child processes, for the tests that run
the CLI, the examples, the notebook and the docs' code blocks."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
GRAMMARS = ROOT / "grammars"
# A short closed schema for the tests that run the CLI on the default model: it completes
# one in ~15 tokens, where the demo schema (examples/extract.schema.json) takes ~150.
SHORT_SCHEMA = {
    "type": "object",
    "properties": {"kind": {"enum": ["support_ticket", "review", "invoice"]}, "urgent": {"type": "boolean"}},
    "required": ["kind", "urgent"],
}


def subprocess_env() -> dict[str, str]:
    """Environment for child processes: the source tree importable even without an
    editable install, and no TTY-only output (progress bars) to parse around."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def deep_schema(n: int) -> dict:
    """An object schema nested ``n`` levels deep (one property in each)."""
    root = node = {"type": "object"}
    for _ in range(n):
        node["properties"] = {"a": {"type": "object"}}
        node = node["properties"]["a"]
    return root
