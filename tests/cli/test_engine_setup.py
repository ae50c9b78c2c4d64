"""What the subcommands share (engine_setup.py): the sampling flags mean what SamplingParams'
fields mean, and a bad spec is refused by a compile with the model's tokenizer before the
weights load."""

from __future__ import annotations

import json
from pathlib import Path

from constrained_serve.cli import main


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_sampling_flags_reach_the_params(tiny_engine_factory, capsys) -> None:
    """--top-p/--top-k/--min-p/--stop mean what SamplingParams' fields mean."""
    from constrained_serve import SamplingParams

    eng = tiny_engine_factory()
    flags = [
        "--max-tokens",
        "24",
        "--temperature",
        "1",
        "--seed",
        "3",
        "--top-p",
        "0.9",
        "--top-k",
        "40",
        "--min-p",
        "0.01",
    ]
    p = SamplingParams(max_tokens=24, temperature=1.0, seed=3, top_p=0.9, top_k=40, min_p=0.01)
    ref = eng.generate("a b c", p)[0].text
    assert main(["generate", "a b c", "--raw", *flags], engine=eng) == 0
    assert capsys.readouterr().out == ref + "\n"
    stop = ref[len(ref) // 2 : len(ref) // 2 + 2]
    assert main(["generate", "a b c", "--raw", *flags, "--stop", stop, "--stop", "\x00"], engine=eng) == 0
    assert capsys.readouterr().out == ref[: ref.index(stop)] + "\n"
    assert main(["generate", "a b c", "--raw", "--top-p", "0"], engine=eng) == 2
    assert "top_p must be" in capsys.readouterr().err


def test_bad_spec_is_refused_before_the_weights_load(tiny_llama_dir, tmp_path, capsys) -> None:
    """The spec is compiled with the model's tokenizer first: here the weights are missing,
    and the error is the grammar's, found before the model load would have failed."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model, ignore=shutil.ignore_patterns("*.safetensors*"))
    src = write_lines(tmp_path / "in.jsonl", [json.dumps({"id": 1, "text": "hi"})])
    grammar = tmp_path / "bad.lark"
    grammar.write_text("start: undefined_rule\n")
    out = tmp_path / "out.jsonl"
    for argv in (["extract", str(src), "-o", str(out)], ["generate", "hi"]):
        assert main(argv + ["--grammar", str(grammar), "--model", str(model)]) == 2
        err = capsys.readouterr().err
        assert "bad.lark" in err and "undefined_rule" in err and "cannot load" not in err, err
    assert not out.exists()
    # A good spec gets as far as the model load, which names the missing weights.
    assert main(["generate", "hi", "--regex", "[a-z]+", "--model", str(model)]) == 2
    assert "cannot load" in capsys.readouterr().err


def test_open_objects_flag(tmp_path) -> None:
    """--schema FILE's objects are closed by the engine; --open-objects keeps them open."""
    from constrained_serve.cli.command import build_parser
    from constrained_serve.cli.engine_setup import output_spec

    schema = write_lines(tmp_path / "s.json", [json.dumps({"type": "object", "properties": {"a": {}}})])
    for flags, expected in (([], None), (["--open-objects"], True)):
        args = build_parser().parse_args(["generate", "hi", "--schema", str(schema), *flags])
        assert output_spec(args, default_any_json=True).kwargs.get("json_open_objects") is expected
