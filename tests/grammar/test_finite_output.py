"""Rules that can never end: found in xgrammar's printed EBNF, refused at compile time.

On such a rule xgrammar's jump-forward search never returned and grew in memory without
bound (fast-forward called it): one recursive required property took the engine down."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import xgrammar as xgr

from constrained_serve.errors import GrammarError
from constrained_serve.grammar.finite_output import rules_without_finite_text

GRAMMARS = Path(__file__).resolve().parents[2] / "grammars"
BENCH = Path(__file__).resolve().parents[3] / "shared" / "data" / "jsonschemabench"
RECURSIVE = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}


@pytest.mark.parametrize(
    "grammar, stuck",
    [
        (xgr.Grammar.from_ebnf('root ::= "a" root'), ["root"]),
        (xgr.Grammar.from_ebnf('root ::= "q" | "x" y\ny ::= "{" y "}"'), ["y"]),
        (xgr.Grammar.from_ebnf('root ::= "x" y+\ny ::= "a" y'), ["root", "root_1", "y"]),  # y+ is root_1
        (xgr.Grammar.from_ebnf('root ::= "x" y*\ny ::= "a" y'), ["y"]),
        (xgr.Grammar.from_ebnf('root ::= "x" y{0,3} | "z"\ny ::= "a" | "b" y'), []),
        (xgr.Grammar.from_json_schema(json.dumps(RECURSIVE)), ["root", "root_prop_0"]),
        (xgr.Grammar.from_json_schema(json.dumps({**RECURSIVE, "required": []})), []),
        (xgr.Grammar.from_regex("(ab)+c{2,3}[x-z]?"), []),
    ],
)
def test_rules_that_cannot_end(grammar, stuck):
    assert rules_without_finite_text(str(grammar)) == stuck


def test_unreadable_text_gives_no_answer():
    assert rules_without_finite_text("root ::= (unclosed") is None
    assert rules_without_finite_text("not a grammar") is None


@pytest.mark.parametrize("path", sorted(GRAMMARS.glob("*.lark")), ids=lambda p: p.name)
def test_shipped_grammars_can_end(path):
    assert rules_without_finite_text(str(xgr.Grammar.from_lark(path.read_text()))) == []


def test_no_jsonschemabench_schema_is_refused():
    """Conservative: read every schema of the corpus xgrammar converts, refuse none of them."""
    files = sorted(BENCH.glob("*.json"))
    assert len(files) > 1000, f"the JSONSchemaBench sample is missing under {BENCH}"
    read = 0
    for p in files[::8]:  # every 8th: the biggest grammars take 0.3 s each
        try:
            g = str(
                xgr.Grammar.from_json_schema(
                    json.dumps(json.loads(p.read_text()).get("schema")), any_whitespace=False, strict_mode=False
                )
            )
        except Exception:  # noqa: BLE001 - not convertible: nothing to check
            continue
        result = rules_without_finite_text(g)
        assert result == [], (p.name, result)
        read += 1
    assert read > 100


@pytest.mark.parametrize(
    "spec",
    [dict(grammar='start: "a" start'), dict(schema=RECURSIVE), dict(grammar='start: "q" | "x" y\ny: "{" y "}"')],
    ids=["lark", "schema", "branch"],
)
def test_xgrammar_refuses_them_at_submit(tiny_engine_factory, spec):
    """Refused before any model work (the engine used to hang in fast-forward, memory
    growing by gigabytes)."""
    eng = tiny_engine_factory()
    from constrained_serve import SamplingParams

    with pytest.raises(GrammarError, match="never"):
        eng.generate(["x"], SamplingParams(max_tokens=6), grammar_backend="xgrammar", **spec)
    [ok] = eng.generate(
        ["x"], SamplingParams(max_tokens=6), grammar_backend="xgrammar", grammar='start: "q" | "x" y\ny: "{" y? "}"'
    )
    assert ok.finish_reason in ("stop", "length")
