"""Grounded string fields (grammar/grounding.py, grammar/grounded_lark.py) without a model:
llguidance's real matcher on the default tokenizer, walked with random allowed tokens (any
token the mask lets through, so every output the grammar allows may come out), and every
finished output must be valid JSON of the schema whose grounded values are verbatim spans."""

from __future__ import annotations

import dataclasses
import json
import random
import time

import numpy as np
import pytest

from constrained_serve.errors import GrammarError
from constrained_serve.grammar.grounded_lark import grounded_grammar
from constrained_serve.grammar.grounding import chunks, find_span, has_matching_span, spans_of
from constrained_serve.grammar.output_check import parse_output
from constrained_serve.grammar.spec import make_output_spec
from constrained_serve.params import Grounding

from .conftest import MODEL_VOCAB

# Quotes, backslashes, newlines, tabs, a control character, Unicode, emoji, a word twice.
NASTY = (
    'Hi, I\'m Zoë "Z" Müller of Acme\\Corp.\nCall +49 (0)30 1234; mail zoe@acme.de\t— '
    "日本語のテキスト 😀👍🏽 and \x01 end. Acme\\Corp again, Zoë!"
)
CONTACT = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "x-grounded": True, "maxLength": 20},
        "email": {"type": ["string", "null"], "x-grounded": True},
        "phones": {"type": "array", "items": {"type": "string", "x-grounded": "chars"}, "maxItems": 2},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "kind": {"enum": ["a", "b"]},
        "note": {"type": "string", "maxLength": 8},  # not grounded unless grounded=True
    },
    "required": ["name", "email", "n"],
}


@pytest.fixture(scope="module")
def llg(tokenizer):
    from constrained_serve.grammar.llguidance import LLGuidanceBackend
    from constrained_serve.grammar.tokenizer_data import TokenizerData

    return LLGuidanceBackend(TokenizerData.from_hf(tokenizer, MODEL_VOCAB))


def grounded(schema, source=NASTY, unit="words", all_strings=False, sources=None, **kw):
    spec = make_output_spec(schema=schema, **kw)
    return dataclasses.replace(spec, grounding=Grounding(sources or (source,), unit, all_strings))


def walk(backend, tokenizer, compiled, seed: int, max_steps: int = 400) -> str | None:
    """A random path through the grammar: each step a random token the mask allows (EOS only
    when nothing else is); None if it did not finish."""
    from constrained_serve.grammar.base import allocate_bitmask, allowed_tokens

    rng = random.Random(seed)
    m = backend.new_matcher(compiled)
    bm = allocate_bitmask(1, MODEL_VOCAB)
    ids: list[int] = []
    eos = tokenizer.eos_token_id  # once: the tokenizer's attribute lookup is slow
    for _ in range(max_steps):
        if m.is_finished():
            break
        forced = m.forced_tokens()
        if forced:
            assert m.accept_tokens(forced)
            ids += forced
            continue
        m.fill_bitmask(bm, 0)
        allowed = [int(t) for t in np.flatnonzero(allowed_tokens(bm[0], MODEL_VOCAB))]
        choice = [t for t in allowed if t != eos] or allowed
        t = rng.choice(choice)
        assert m.accept_tokens([t])
        ids.append(t)
    if not m.is_finished():
        return None
    return tokenizer.decode([i for i in ids if i != eos])


def check(spec, text: str) -> dict:
    """The output parses, validates against the schema and its grounded values are spans."""
    value, _ = parse_output(spec, text)  # jsonschema + check_grounded: raises otherwise
    for path, (start, end) in spans_of(spec, value).items():
        got = value
        for part in path[2:].replace("[", ".[").split("."):
            got = got[int(part[1:-1])] if part.startswith("[") else got[part]
        assert spec.grounding.text[start:end] == got
    return value


def test_chunks_and_spans_keep_to_word_boundaries():
    assert chunks("O'Brien, 1,200.00 EUR", "words") == [
        "O",
        "'",
        "Brien",
        ",",
        " ",
        "1",
        ",",
        "200",
        ".",
        "00",
        " ",
        "EUR",
    ]
    assert chunks("ab", "chars") == ["a", "b"]
    assert find_span("John Johnson", "John", "words") == (0, 4)
    assert find_span("Johnson and John", "John", "words") == (12, 16)  # not inside "Johnson"
    assert find_span("Johnson", "ohn", "words") is None and find_span("Johnson", "ohn", "chars") == (1, 4)
    assert find_span("a b a b", "a b", "words") == (0, 3)  # the same span twice: the first


@pytest.mark.parametrize("unit", ["words", "chars"])
def test_random_walks_give_verbatim_spans_through_escapes(llg, tokenizer, unit):
    spec = grounded(CONTACT, unit=unit)
    compiled = llg.compile(spec)
    seen = 0
    for seed in range(25):
        text = walk(llg, tokenizer, compiled, seed)
        if text is None:
            continue
        value = check(spec, text)
        seen += 1
        assert isinstance(value.get("note", ""), str)
    assert seen >= 20


def test_the_grammar_refuses_what_is_not_a_span(llg):
    spec = grounded(CONTACT)
    compiled = llg.compile(spec)

    def ok(name: str, email: str = "null") -> bool:
        return llg.matches(compiled, '{"name":' + json.dumps(name, ensure_ascii=False) + f',"email":{email},"n":1}}')

    assert ok('Zoë "Z" Müller') and ok("Acme\\Corp") and ok("😀👍🏽") and ok("日本語のテキスト")
    assert ok("Zoë", '"zoe@acme.de"') and ok("")
    assert not ok("oë") and not ok("Zoe") and not ok("Müller Zoë") and not ok("Acme Corp")
    # the same text escaped another way ("\u00eb" for "ë") is not the source's spelling
    assert not llg.matches(compiled, '{"name":"Zo\\u00eb","email":null,"n":1}')
    # maxLength holds (counted in characters, an escape being one)
    assert not ok('Zoë "Z" Müller of Acme\\Corp')


def test_grounded_true_takes_every_plain_string_and_nullable_fields_may_be_null(llg, tokenizer):
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "string"},
            "b": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "fmt": {"type": "string", "format": "date"},  # keeps its own constraint
        },
        "required": ["a", "b", "fmt"],
    }
    spec = grounded(schema, all_strings=True, source="the quick brown fox")
    compiled = llg.compile(spec)
    assert llg.matches(compiled, '{"a":"quick brown","b":null,"fmt":"2024-01-31"}')
    assert not llg.matches(compiled, '{"a":"slow","b":null,"fmt":"2024-01-31"}')
    assert not llg.matches(compiled, '{"a":"fox","b":"dog","fmt":"2024-01-31"}')
    assert not llg.matches(compiled, '{"a":"fox","b":null,"fmt":"the quick"}')
    for seed in range(5):
        text = walk(llg, tokenizer, compiled, seed)
        if text is not None:
            check(spec, text)


def test_pydantic_nested_models_and_a_chat_with_two_messages(llg, tokenizer):
    from pydantic import BaseModel

    from constrained_serve import Grounded

    class Person(BaseModel):
        name: Grounded
        email: Grounded | None = None

    class Team(BaseModel):
        people: list[Person]
        lead: Person | None

    spec = grounded(Team, sources=("Ann Lee, ann@x.io", "Bo Chen bo@y.org"))
    compiled = llg.compile(spec)
    assert llg.matches(compiled, '{"people":[{"name":"Ann Lee","email":"ann@x.io"}],"lead":{"name":"Bo Chen"}}')
    assert not llg.matches(compiled, '{"people":[],"lead":{"name":"x.io\\n\\nBo"}}')  # never across messages
    texts = [t for t in (walk(llg, tokenizer, compiled, seed) for seed in range(8)) if t is not None]
    assert texts
    for text in texts:
        _, parsed = parse_output(spec, text)
        assert isinstance(parsed, Team)
        spans = spans_of(spec, json.loads(text))
        assert all(
            spec.grounding.text[s:e] in spec.grounding.sources[0] + spec.grounding.sources[1] for s, e in spans.values()
        )


def test_a_long_source_compiles_fast_and_walks(llg, tokenizer):
    rng = random.Random(0)
    words = ["alpha", "Beta", "O'Neil", '"q"', "back\\slash", "1,200.00", "EUR", "x@y.io", "new\nline", "Zoë", "😀"]
    source = " ".join(rng.choice(words) for _ in range(5000))
    spec = grounded({"type": "object", "properties": {"v": {"type": "string", "x-grounded": True}}}, source=source)
    t0 = time.perf_counter()
    compiled = llg.compile(spec)
    assert time.perf_counter() - t0 < 5.0  # benchmarks/grounded.py measures it; this is a loose bound
    for seed in range(3):
        text = walk(llg, tokenizer, compiled, seed, max_steps=60)
        if text is not None:
            check(spec, text)


@pytest.mark.parametrize(
    "schema, what",
    [
        (
            {
                "type": "object",
                "properties": {"a": {"type": "string", "x-grounded": True}},
                "additionalProperties": True,
            },
            "open",
        ),
        ({"not": {"type": "integer"}, "anyOf": [{"type": "string", "x-grounded": True}]}, "anyOf beside not"),
        ({"type": "array", "prefixItems": [{"type": "string", "x-grounded": True}]}, "prefixItems"),
    ],
)
def test_shapes_the_grammar_cannot_express_are_refused(schema, what):
    with pytest.raises(GrammarError, match="grounded fields") as e:
        grounded_grammar(grounded(schema, json_open_objects=True))
    assert what.split()[0] in str(e.value)


def test_xgrammar_refuses_with_the_reason_and_the_cache_keeps_grounded_grammars_apart(tokenizer):
    from constrained_serve.grammar import GrammarManager

    m = GrammarManager(tokenizer, MODEL_VOCAB, max_workers=1, cache_size=3)
    try:
        with pytest.raises(GrammarError, match="xgrammar cannot compile grounded fields") as e:
            m.compile(grounded(CONTACT), "xgrammar")
        assert e.value.reason == "grounded fields need llguidance"
        plain = make_output_spec(schema={"type": "object", "properties": {"x": {"type": "integer"}}})
        m.compile(plain)
        for i in range(6):  # one grammar per row: six sources
            m.compile(grounded(CONTACT, source=f"row {i}: Ann Lee"))
        hits = m.stats["hits"]
        m.compile(plain)  # still cached: grounded rows never push it out
        m.compile(grounded(CONTACT, source="row 5: Ann Lee"))  # the latest rows are cached too
        assert m.stats["hits"] == hits + 2
        misses = m.stats["misses"]
        m.compile(grounded(CONTACT, source="row 0: Ann Lee"))  # beyond the bound: compiled again
        assert m.stats["misses"] == misses + 1
    finally:
        m.close()


EMAIL = r"^[^@\s]+@[^@\s]+\.[a-z]+$"


def test_a_pattern_and_a_span_both_hold_and_no_matching_span_leaves_only_null(llg, tokenizer):
    schema = {
        "type": "object",
        "properties": {
            "email": {"type": ["string", "null"], "pattern": EMAIL},
            "amount": {"type": ["string", "null"], "pattern": "[0-9]"},  # a search, as JSON Schema reads it
            "path": {"type": ["string", "null"], "pattern": "^a/b"},  # a slash inside the Lark regex
            "free": {"type": ["string", "null"], "pattern": "x", "maxLength": 4, "x-grounded": False},  # opted out
            "day": {"type": ["string", "null"], "format": "date"},  # keeps its own constraint
        },
        "required": ["email", "amount", "path", "free", "day"],
    }
    source = 'Mail zoe@acme.de or "x"@y.org, pay 45 EUR, see a/b/c.'
    spec = grounded(schema, all_strings=True, source=source)
    compiled = llg.compile(spec)

    def ok(email="null", amount="null", path="null", free="null", day="null") -> bool:
        return llg.matches(compiled, f'{{"email":{email},"amount":{amount},"path":{path},"free":{free},"day":{day}}}')

    assert ok() and ok('"zoe@acme.de"', '"45 EUR"', '"a/b/c"') and ok(amount='"pay 45"', path='"a/b"')
    assert ok(free='"xyz"', day='"2024-01-31"')  # neither is grounded
    assert not ok('"Mail zoe@acme.de"') and not ok('"acme.de"') and not ok('"zoe@example.de"')  # pattern / span
    assert not ok(amount='"EUR"') and not ok(path='"b/c"')
    # a span holding a quote is never a pattern field's value (the pattern reads the value, not its escapes)
    assert not ok('"\\"x\\"@y.org"')
    texts = [t for t in (walk(llg, tokenizer, compiled, seed) for seed in range(4)) if t is not None]
    assert len(texts) >= 3
    for text in texts:
        check(spec, text)

    # no span of this source is an email: after the key, only null can follow
    spec = grounded(schema, all_strings=True, source="no address here, 45 EUR")
    m = llg.new_matcher(llg.compile(spec))
    assert m.accept_tokens(tokenizer.encode('{"email":', add_special_tokens=False))
    assert tokenizer.decode(m.forced_tokens()).startswith("null")


def test_a_pattern_with_an_anchor_inside_is_refused():
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "a^b", "x-grounded": True}}}
    with pytest.raises(GrammarError, match="anchor"):
        grounded_grammar(grounded(schema))


def test_null_if_no_match_takes_a_matching_span_where_there_is_one(llg, tokenizer):
    field = {"type": ["string", "null"], "pattern": EMAIL, "maxLength": 30, "x-null-if-no-match": True}
    schema = {"type": "object", "properties": {"email": field}, "required": ["email"]}
    spec = grounded(schema, all_strings=True, source='Ann "A" Lee, ann@x.io, and "b"@y.org')
    compiled = llg.compile(spec)
    assert llg.matches(compiled, '{"email":"ann@x.io"}')
    assert not llg.matches(compiled, '{"email":null}')  # a span matches: null is gone
    for seed in range(5):
        text = walk(llg, tokenizer, compiled, seed)
        assert text is not None and check(spec, text) == {"email": "ann@x.io"}
    spec = grounded(schema, all_strings=True, source='only "b"@y.org, which a quote spoils')
    assert llg.matches(llg.compile(spec), '{"email":null}')  # none does: null it is
    # the span search: whole words, within maxLength, nothing JSON escapes
    assert has_matching_span(("mail ann@x.io now",), "words", EMAIL, 0, 30)
    assert not has_matching_span(("mail ann@x.io now",), "words", EMAIL, 0, 7)
    assert not has_matching_span(('"a"@x.io',), "words", EMAIL, 0, 30)
    assert not has_matching_span(("nn@x.io",), "words", "^ann@", 0, 30)
    assert has_matching_span(("xann@x.io",), "chars", "^ann@", 0, 30)
    for bad in (
        {"type": "string", "pattern": "a", "maxLength": 9},  # not nullable
        {"type": ["string", "null"], "maxLength": 9},  # no pattern
        {"type": ["string", "null"], "pattern": "a"},  # no maxLength
    ):
        field = {**bad, "x-null-if-no-match": True, "x-grounded": True}
        with pytest.raises(GrammarError, match="x-null-if-no-match"):
            grounded_grammar(grounded({"type": "object", "properties": {"e": field}}))


def test_the_demo_schema_without_grounding_compiles_and_xgrammar_refuses_it_grounded(manager):
    from ..helpers import EXAMPLES

    schema = json.loads((EXAMPLES / "extract.schema.json").read_text())
    compiled = manager.compile(make_output_spec(schema=schema))  # "x-null-if-no-match" means nothing here
    value = '{"person":null,"company":null,"reference":"A-1234","amount":"12.50 EUR","email":null,"due_date":null}'
    assert manager.matches(compiled, value)
    assert not manager.matches(compiled, value.replace("12.50 EUR", "twelve"))  # the pattern holds
    with pytest.raises(GrammarError, match="xgrammar cannot compile grounded"):
        manager.compile(grounded(schema, all_strings=True, source="A-1234, 12.50 EUR"), "xgrammar")
