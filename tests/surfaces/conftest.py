"""Shared fixtures for the user-surface tests (CLI, examples, notebook, grammars, display)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
GRAMMARS = ROOT / "grammars"


def subprocess_env() -> dict[str, str]:
    """Environment for child processes: the source tree importable even without an
    editable install, and no TTY-only output (progress bars) to parse around."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


@pytest.fixture(scope="session")
def engine(default_engine):
    """The session's default-model Engine (tests/conftest.py), shared with the engine tests:
    loading the model is the slowest part of these tests, so it happens once."""
    return default_engine


@pytest.fixture(scope="session")
def python() -> str:
    return sys.executable
