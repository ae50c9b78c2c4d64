"""Structured generation through the engine, end to end on the real default model and on the
tiny one: every completed output matches its spec (jsonschema validation, regex fullmatch,
Pydantic parsing) and a truncated or refused one says so; a dead end or a failing backend
aborts its request alone; overlapped (masks prefilled) or synchronous loops, one or two mask workers,
fast-forward on or off agree; a request waits while its grammar compiles."""

import json
import re
from concurrent.futures import Future
from pathlib import Path
from typing import Literal

import jsonschema
import pydantic
import pytest
from pydantic import BaseModel

from constrained_serve import GrammarError, OutputError, OutputValidationError, SamplingParams

from .specs import RECORD, Refused

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "jsonschemabench"
BASELINE = Path(__file__).resolve().parents[1] / "grammar" / "baseline_jsonschemabench.json"


def pick_schemas(n=40, max_chars=600):
    """A deterministic spread of small schemas that llguidance compiles, across splits."""
    if not DATA.is_dir():
        pytest.fail(f"missing shared corpus {DATA}")
    base = json.loads(BASELINE.read_text())["llguidance"]
    names = sorted(k for k, v in base.items() if v["compiled"])
    out = []
    for name in names:
        schema = json.loads((DATA / name).read_text())["schema"]
        text = json.dumps(schema)
        if len(text) <= max_chars and "format" not in text:
            out.append((name, schema))
    step = max(1, len(out) // n)
    return out[::step][:n]


def _prompt(schema):
    return [
        {"role": "system", "content": "You write JSON that follows the given JSON Schema."},
        {"role": "user", "content": "Schema:\n" + json.dumps(schema)[:600] + "\nWrite one example."},
    ]


class Invoice(BaseModel):
    vendor: str
    total: float
    currency: Literal["EUR", "USD"]


@pytest.mark.slow
def test_forty_bench_schemas_in_one_batch_validate(default_engine):
    picked = pick_schemas()
    assert len(picked) >= 40
    schemas = [s for _, s in picked]
    # Mixed batch: constrained rows plus two unconstrained rows (schema None); greedy and
    # sampled rows side by side (every other schema at temperature 0.8, seeded), one batch.
    prompts = [_prompt(s) for s in schemas] + [[{"role": "user", "content": "Say hi."}]] * 2
    specs = schemas + [None, None]
    params = [SamplingParams(max_tokens=128, temperature=0.8 * (i % 2), seed=7 + i) for i in range(len(prompts))]
    rs = default_engine.chat(prompts, params, schema=specs)
    done = 0
    for (name, schema), r in zip(picked, rs):
        assert r.finish_reason in ("stop", "length"), (name, r.error)
        if r.finish_reason == "stop":
            jsonschema.validate(json.loads(r.text), schema)
            assert r.json == json.loads(r.text)
            done += 1
        else:
            assert r.json is None and r.parsed is None and "truncated" in r.error
    assert done >= len(picked) // 2, f"only {done} of {len(picked)} outputs completed"
    assert rs[-1].json is None and rs[-1].error is None


@pytest.mark.slow
def test_pydantic_regex_choices_and_lark(default_engine):
    eng = default_engine
    msgs = [{"role": "user", "content": "Invoice: ACME GmbH, total 1234.50 EUR. Extract it as JSON."}]
    [r] = eng.chat(msgs, SamplingParams(max_tokens=80), schema=Invoice)
    assert isinstance(r.parsed, Invoice) and r.parsed.currency in ("EUR", "USD")
    assert r.usage.forced_tokens > 0
    [lst] = eng.chat(msgs, SamplingParams(max_tokens=120), schema=list[Invoice])
    if lst.finish_reason == "stop":
        assert all(isinstance(x, Invoice) for x in lst.parsed)
    pattern = r"\d{4}-\d{2}-\d{2}"
    for r in eng.generate(
        ["The date today is", "Born on"], SamplingParams(max_tokens=20, temperature=1.0, seed=3), regex=pattern
    ):
        assert r.finish_reason == "stop" and re.fullmatch(pattern, r.text)
    [c] = eng.chat(
        [{"role": "user", "content": "Is water wet? yes or no"}],
        SamplingParams(max_tokens=5),
        choices=["yes", "no", "unsure"],
    )
    assert c.text in ("yes", "no", "unsure")
    import lark  # in the test extra; a missing install fails here, loudly

    grammar = 'start: expr\nexpr: NUMBER | expr OP expr | "(" expr ")"\nOP: "+" | "-" | "*"\nNUMBER: /[0-9]{1,3}/\n'
    [g] = eng.generate(["Arithmetic: "], SamplingParams(max_tokens=24), grammar=grammar)
    if g.finish_reason == "stop":
        lark.Lark(grammar.replace("{1,3}", "+")).parse(g.text)
    [o] = eng.chat(
        [{"role": "user", "content": "A JSON object about a dog."}],
        SamplingParams(max_tokens=60),
        response_format={"type": "json_object"},
    )
    if o.finish_reason == "stop":
        assert isinstance(o.json, dict)


@pytest.mark.slow
def test_truncation_is_flagged_never_repaired(default_engine):
    msgs = [{"role": "user", "content": "Invoice: ACME GmbH, total 1234.50 EUR."}]
    [r] = default_engine.chat(msgs, SamplingParams(max_tokens=5), schema=Invoice)
    assert r.finish_reason == "length" and r.json is None and r.parsed is None
    assert r.error_type == "truncated" and "truncated" in r.error
    with pytest.raises(OutputError, match="truncated"):
        default_engine.chat(msgs, SamplingParams(max_tokens=5), schema=Invoice, raise_on_error=True)


def test_valid_json_refused_by_the_pydantic_type_keeps_its_json(tiny_engine_factory):
    eng = tiny_engine_factory()
    [r] = eng.generate(["x"], SamplingParams(max_tokens=20), schema=Refused)
    assert r.finish_reason == "stop" and isinstance(r.json, dict) and set(r.json) == {"flag"}
    assert r.parsed is None and r.error_type == "OutputValidationError" and "never acceptable" in r.error
    # raise_on_error raises the specific, catchable type: its value, and Pydantic's errors as the cause.
    with pytest.raises(OutputValidationError, match="never acceptable") as e:
        eng.generate(["x"], SamplingParams(max_tokens=20), schema=Refused, raise_on_error=True)
    assert isinstance(e.value, OutputError) and e.value.value == r.json
    assert isinstance(e.value.__cause__, pydantic.ValidationError)


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_dead_end_in_a_grammar_aborts_that_request_with_the_reason(tiny_engine_factory, backend):
    # "a" is forced, then the rule b matches nothing: the mask allows only EOS, which the
    # grammar does not accept. That request ends with a GrammarError saying so; the rest run.
    eng = tiny_engine_factory(grammar_backend=backend)
    dead = 'start: "a" b\nb: /[^\\s\\S]/\n'
    rs = eng.generate(["x", "y"], SamplingParams(max_tokens=8), grammar=[dead, None])
    assert rs[0].finish_reason == "abort" and rs[0].error_type == "GrammarError"
    assert "cannot be completed" in rs[0].error and "'a'" in rs[0].error, rs[0].error
    assert rs[1].error is None and rs[1].finish_reason == "length"


def test_a_backend_failing_mid_output_is_an_error_never_a_success(tiny_engine_factory):
    """llguidance gives up on a parser row over 2,000 items (a rule with 2,001 alternatives)
    and then reports itself "stopped": that must end the request as an abort carrying
    llguidance's reason (one line of it), never as a finished, valid-looking output."""
    eng = tiny_engine_factory()
    wide = "start: " + " | ".join(f'"opt{i}"' for i in range(2001))
    rs = eng.generate(["x", "y"], SamplingParams(max_tokens=8), grammar=[wide, None])
    assert rs[0].finish_reason == "abort" and rs[0].error_type == "GrammarError", rs[0]
    assert "llguidance failed after" in rs[0].error and "2000" in rs[0].error and "\n" not in rs[0].error
    assert rs[1].error is None and rs[1].finish_reason == "length"


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_thousands_of_choices(tiny_engine_factory, backend):
    """Choices compile to one lexeme on llguidance, so its parser-row limit does not apply."""
    eng = tiny_engine_factory(grammar_backend=backend)
    choices = [f"opt{i}" for i in range(5000)] + ["yes", "yes!"]
    rs = eng.generate(
        ["x", "y"],
        [SamplingParams(max_tokens=8), SamplingParams(max_tokens=8, temperature=1.0, seed=3)],
        choices=choices,
    )
    assert all(r.error is None and r.finish_reason == "stop" and r.text in choices for r in rs), rs


def test_truncated_complete_match_says_it_may_be_cut(tiny_engine_factory):
    eng = tiny_engine_factory()
    [r] = eng.generate(["x"], SamplingParams(max_tokens=3), regex="[a-z ]+")
    assert r.finish_reason == "length" and r.parsed is None and r.error_type == "truncated"
    assert "complete regex match but may be cut short" in r.error


def test_overlapped_and_synchronous_loops_give_identical_tokens(tiny_engine_factory):
    schema = RECORD
    prompts = [f"record {i}:" for i in range(6)]
    outs = []
    for overlap in (True, False):
        eng = tiny_engine_factory(overlap=overlap)
        rs = eng.generate(
            prompts,
            SamplingParams(max_tokens=40, temperature=0.7, seed=5),
            schema=[schema, None, schema, None, schema, schema],
        )
        outs.append([r.token_ids for r in rs])
        # The overlapped loop takes most masks from the prefill after each step's advance
        # (grammar/manager.py prefill_masks); the synchronous one fills every mask in its step.
        assert (eng.grammar.stats["prefilled_rows"] > 20) == overlap
    assert outs[0] == outs[1]


def test_rows_split_over_two_mask_workers_give_the_same_tokens(tiny_engine_factory):
    """grammar_mask_workers=2 splits each step's rows over two worker processes; the masks,
    and so the sampled tokens, are the same as with one."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
        "required": ["name", "n"],
    }
    prompts = [f"record {i}:" for i in range(5)]
    outs = []
    for workers in (1, 2):
        eng = tiny_engine_factory(grammar_mask_workers=workers)
        rs = eng.generate(prompts, SamplingParams(max_tokens=30, temperature=0.7, seed=3), schema=schema)
        assert all(r.error_type in (None, "truncated") for r in rs), [r.error for r in rs]
        assert len(eng.grammar.workers.maskers["llguidance"]) == workers
        outs.append([r.token_ids for r in rs])
    assert outs[0] == outs[1]
    for bad in (0, 65, 1.5, True):
        with pytest.raises(ValueError, match="grammar_mask_workers"):
            tiny_engine_factory(grammar_mask_workers=bad)


def test_fast_forward_on_and_off_both_validate(tiny_engine_factory):
    schema = {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["color", "size"],
        "additionalProperties": False,
    }
    texts = {}
    for ff in (True, False):
        eng = tiny_engine_factory(fast_forward=ff)
        rs = eng.generate([f"item {i}" for i in range(4)], SamplingParams(max_tokens=40), schema=schema)
        for r in rs:
            assert r.finish_reason == "stop", r.error
            jsonschema.validate(r.json, schema)
        texts[ff] = [r.text for r in rs]
        forced = sum(r.usage.forced_tokens for r in rs)
        assert (forced > 0) == ff
    # The forced parts are the only legal bytes either way, so greedy texts agree.
    assert texts[True] == texts[False]


def test_sampled_outputs_always_match(tiny_engine_factory):
    eng = tiny_engine_factory()
    pattern = r"[a-c]{2,5}-\d{1,3}"
    rs = eng.generate(
        [f"p{i}" for i in range(8)], SamplingParams(max_tokens=16, temperature=1.5, seed=11), regex=pattern
    )
    for r in rs:
        if r.finish_reason == "stop":
            assert re.fullmatch(pattern, r.text), r.text
        else:
            assert r.error_type == "truncated"


def test_request_waits_while_its_grammar_compiles(tiny_engine_factory):
    """A request whose compile is still running is not admitted; the others keep decoding."""
    from constrained_serve.engine.request import GrammarState, Request

    eng = tiny_engine_factory()
    _ = eng.grammar  # create the manager
    slow = Request(eng.encode_prompt("slow"), SamplingParams(max_tokens=3, ignore_eos=True))
    slow.grammar = GrammarState(future=Future())  # compile "in progress"
    fast = Request(eng.encode_prompt("fast"), SamplingParams(max_tokens=3, ignore_eos=True))
    eng.core.add(slow)
    eng.core.add(fast)
    while not fast.finished:
        eng.core.step()
    assert slow.num_computed == 0 and not slow.finished
    slow.grammar.future.set_exception(GrammarError("boom", backend="test"))
    eng.core.step()
    assert slow.finished and slow.error_type == "GrammarError"
