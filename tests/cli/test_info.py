"""``constrained-serve info`` (info.py): what this install would run on, as text and as JSON."""

from __future__ import annotations

import json

from constrained_serve.cli import main


def test_info(capsys) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "constrained-serve 0.1.0" in out and "llguidance" in out and "SmolLM2" in out
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["grammar_backends"]["llguidance"] and info["device"]["auto"] in ("cpu", "cuda")
