"""Fixtures of the docs and examples tests."""

from __future__ import annotations

import pytest

from ..helpers import ROOT


@pytest.fixture
def shared_engine(engine, monkeypatch):
    """``Engine()`` and the one-liner's default engine are the session's engine; any other
    ``Engine(...)`` builds a real one. Paths in the pages are relative to the repository."""
    import constrained_serve
    from constrained_serve.api import Engine

    def make(*args, **kwargs):
        return engine if not args and not kwargs else Engine(*args, **kwargs)

    monkeypatch.setattr(constrained_serve, "Engine", make)
    monkeypatch.setattr(constrained_serve, "_default_engine", engine)
    monkeypatch.chdir(ROOT)
    return engine
