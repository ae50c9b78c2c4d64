"""``constrained-serve generate`` (command.py): exit 2 for a prompt it cannot take; a JSON
value or a raw prompt's continuation on stdout, on the real default model."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from constrained_serve.cli import main

from ..helpers import EXAMPLES

SCHEMA = str(EXAMPLES / "extract.schema.json")


def test_generate_exits_2_for_a_prompt_it_cannot_take(tiny_engine_factory, capsys) -> None:
    eng = tiny_engine_factory()
    for argv in (["generate", "", "--raw"], ["generate", " "], ["generate", "", "--raw", "--regex", "a+"]):
        assert main(argv + ["--max-tokens", "3"], engine=eng) == 2, argv
        assert "prompt is empty" in capsys.readouterr().err
    assert main(["generate", "x " * 9000, "--raw", "--max-tokens", "3"], engine=eng) == 2
    assert "tokens" in capsys.readouterr().err
    assert main(["generate", "hello", "--raw", "--max-tokens", "3"], engine=eng) == 0  # free text cut: fine
    assert "stopped at --max-tokens" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_prints_json(engine, capsys) -> None:
    argv = ["generate", "Describe a red apple.", "--schema", SCHEMA, "--max-tokens", "160"]
    assert main(argv, engine=engine) == 0
    value = json.loads(capsys.readouterr().out)
    jsonschema.validate(value, json.loads(Path(SCHEMA).read_text()))
    assert main(["generate", "Pick a number", "--regex", "[0-9]{2}", "--max-tokens", "5"], engine=engine) == 0
    assert len(capsys.readouterr().out.strip()) == 2


@pytest.mark.slow
def test_generate_raw_prompt(engine, capsys) -> None:
    argv = ["generate", "The capital of France is", "--raw", "--regex", " [A-Z][a-z]{2,10}", "--max-tokens", "6"]
    assert main(argv, engine=engine) == 0
    assert capsys.readouterr().out.startswith(" ")
