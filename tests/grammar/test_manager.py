"""GrammarManager (manager.py) with both grammar engines through their common interface
(base.py), with the real SmolLM2 tokenizer: matchers, masks, forced tokens, rollback, the
compile cache and bounds, what each backend refuses, and Lark as both backends read it."""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging

import pytest
import torch

from constrained_serve.errors import GrammarError, OutputValidationError
from constrained_serve.grammar import GrammarManager, make_output_spec, parse_output

from .grammar_test_types import Person, Point

MODEL_VOCAB = 49152  # SmolLM2-135M logits width (as in conftest)

EOS = 2

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}

# (spec kwargs, accepted texts, rejected texts)
CASES = {
    "regex": ({"regex": r"[0-9]{2,4}-[a-z]+"}, ["12-ab", "1234-z"], ["1-ab", "12ab", "12-AB"]),
    "lark": ({"grammar": 'start: "(" num ("," num)* ")"\nnum: /[0-9]+/'}, ["(1)", "(12,3,456)"], ["()", "(1,)", "1"]),
    "ebnf": ({"grammar": 'root ::= "x" [0-9]+ ("!" | "?")', "grammar_syntax": "ebnf"}, ["x1!", "x42?"], ["x!", "y1!"]),
    "choices": ({"choices": ["yes", "no", "maybe so"]}, ["yes", "no", "maybe so"], ["ye", "yess", "No"]),
    "json_schema": (
        {"schema": PERSON},
        ['{"name":"Bob","age":42}', '{"name":"","age":-1}'],
        ['{"age":42,"name":"Bob"}', '{"name":"Bob"}', '{"name":"Bob","age":4.5}', '{"name": "Bob","age":42}'],
    ),
    "json_object": ({"response_format": {"type": "json_object"}}, ["{}", '{"a":[1,{"b":null}]}'], ["[]", '"x"', "{"]),
    "pydantic": ({"schema": Person}, ['{"name":"A","age":1}'], ['{"name":"A"}']),
    "list_model": (
        {"schema": list[Person]},
        ["[]", '[{"name":"A","age":1},{"name":"B","age":2}]'],
        ['[{"name":"A"}]', '{"name":"A","age":1}'],
    ),
    "typeddict": ({"schema": Point}, ['{"x":1,"y":-2}'], ['{"x":1}', '{"y":1,"x":2}']),
}


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def allowed(bitmask: torch.Tensor, row: int) -> set[int]:
    words = bitmask[row].tolist()
    return {w * 32 + b for w, word in enumerate(words) for b in range(32) if (word >> b) & 1}


def run(manager, backend, tok, spec_kwargs, text):
    """Feed text token by token; (accepted everything, can_end) and the matcher."""
    m = manager.new_matcher(manager.compile(make_output_spec(**spec_kwargs), backend))
    for t in encode(tok, text):
        if not m.accept_tokens([t]):
            return False, m
    return m.can_end(), m


@pytest.mark.parametrize("case", sorted(CASES))
def test_accepts_valid_rejects_invalid(manager, backend, tokenizer, case):
    kwargs, good, bad = CASES[case]
    for text in good:
        ok, m = run(manager, backend, tokenizer, kwargs, text)
        assert ok, f"{backend} rejected valid {text!r}"
        assert m.accept_tokens([EOS]) and m.is_finished() and not m.can_end()
        assert not m.accept_tokens(encode(tokenizer, "x"))  # nothing after EOS
        bm = manager.allocate_bitmask(1)
        manager.fill_bitmask([(0, m)], bm)
        assert allowed(bm, 0) == {EOS}  # finished rows allow EOS only (never an all-masked row)
        m.rollback(1)  # undo EOS only
        assert m.can_end() and m.accept_tokens([EOS]) and m.is_finished()
    for text in bad:
        ok, _ = run(manager, backend, tokenizer, kwargs, text)
        assert not ok, f"{backend} accepted invalid {text!r}"


def test_rejection_leaves_state_unchanged(manager, backend, tokenizer):
    m = manager.new_matcher(manager.compile(make_output_spec(schema=PERSON), backend))
    assert m.accept_tokens(encode(tokenizer, '{"name":"Al'))
    bm = manager.allocate_bitmask(2)
    manager.fill_bitmask([(0, m)], bm)
    # a valid first token followed by an invalid one: the whole call fails, nothing sticks
    assert not m.accept_tokens(encode(tokenizer, 'ice"') + encode(tokenizer, "}}}"))
    manager.fill_bitmask([(1, m)], bm)
    assert torch.equal(bm[0], bm[1])
    assert m.accept_tokens(encode(tokenizer, 'ice","age":7}')) and m.can_end()


def test_forced_tokens_after_brace(manager, backend, tokenizer):
    m = manager.new_matcher(manager.compile(make_output_spec(schema=PERSON), backend))
    assert m.accept_tokens(encode(tokenizer, "{"))
    forced = m.forced_tokens()
    text = tokenizer.decode(forced)
    assert forced and '"name":'.startswith(text) and text.startswith('"'), (forced, text)
    # canonical: the forced run is how the tokenizer itself writes that text
    assert forced == encode(tokenizer, text)
    assert m.forced_tokens() == forced  # no state change
    assert m.accept_tokens(forced)
    assert not m.is_finished()


def test_finished_once_only_eos_may_follow(manager, backend, tokenizer):
    """Both backends end a closed JSON value without a decode step for EOS, and not a text
    that is complete but may still grow."""
    m = manager.new_matcher(manager.compile(make_output_spec(schema=PERSON), backend))
    assert m.accept_tokens(encode(tokenizer, '{"name":"Al","age":7'))
    assert not m.can_end() and not m.is_finished()
    assert m.accept_tokens(encode(tokenizer, "}"))
    assert m.is_finished() and m.can_end()
    m.rollback(1)
    assert not m.is_finished()
    for spec, text in (({"regex": "[a-z]+"}, "abc"), ({"schema": {"type": "integer"}}, "7")):
        free = manager.new_matcher(manager.compile(make_output_spec(**spec), backend))
        assert free.accept_tokens(encode(tokenizer, text)) and free.can_end() and not free.is_finished()


def test_matches_whole_texts(manager, backend):
    """Whole-text check of an output cut by a stop string, whatever its tokenization."""
    person = manager.compile(make_output_spec(schema=PERSON), backend)
    assert manager.matches(person, '{"name":"Zoë","age":7}')
    assert not manager.matches(person, '{"name":"Zoë","age":7')
    assert not manager.matches(person, '{"name":"Zoë"}')
    assert not manager.matches(person, "")
    word = manager.compile(make_output_spec(regex="[a-z]+"), backend)
    assert manager.matches(word, "abc") and not manager.matches(word, "ab1") and not manager.matches(word, "")
    assert manager.matches(manager.compile(make_output_spec(regex="[a-z]*"), backend), "")


def test_forced_tokens_none_when_free(manager, backend, tokenizer):
    m = manager.new_matcher(manager.compile(make_output_spec(regex="[a-z]+"), backend))
    assert m.forced_tokens() == []


def test_rollback_restores_state(manager, backend, tokenizer):
    m = manager.new_matcher(manager.compile(make_output_spec(schema=PERSON), backend))
    head = encode(tokenizer, '{"name":"X",')
    assert m.accept_tokens(head)
    bm = manager.allocate_bitmask(2)
    manager.fill_bitmask([(0, m)], bm)
    tail = encode(tokenizer, '"age":12')
    assert m.accept_tokens(tail)
    m.rollback(len(tail))
    manager.fill_bitmask([(1, m)], bm)
    assert torch.equal(bm[0], bm[1])
    assert m.accept_tokens(tail + encode(tokenizer, "}")) and m.can_end()


def test_bitmask_rows_and_eos(manager, backend, tokenizer):
    compiled = manager.compile(make_output_spec(regex="[0-9]+"), backend)
    a, b = manager.new_matcher(compiled), manager.new_matcher(compiled)
    assert b.accept_tokens(encode(tokenizer, "7"))
    bm = manager.allocate_bitmask(3)
    assert bm.dtype == torch.int32 and bm.shape == (3, (MODEL_VOCAB + 31) // 32)
    manager.fill_bitmask([(0, a), (2, b)], bm)
    assert (bm[1] == -1).all()  # untouched row
    for row in (0, 2):
        toks = allowed(bm, row)
        digits = {t for t in toks if t != EOS}
        assert digits and all(tokenizer.decode([t]).isdigit() for t in digits)
    assert EOS not in allowed(bm, 0) and EOS in allowed(bm, 2)  # EOS exactly where it can end
    assert not a.can_end() and b.can_end()
    # the batch (parallel) fill equals one-by-one fills
    single = manager.allocate_bitmask(3)
    a.fill_bitmask(single, 0)
    b.fill_bitmask(single, 2)
    assert torch.equal(single, bm)


def test_vocab_wider_than_tokenizer(tokenizer, backend):
    width = MODEL_VOCAB + 40  # model logits padded past the tokenizer's vocabulary
    mgr = GrammarManager(tokenizer, width, default_backend=backend, max_workers=1, eos_token_ids=[1])
    try:
        m = mgr.new_matcher(mgr.compile(make_output_spec(response_format={"type": "json_object"})))
        bm = mgr.allocate_bitmask(1)
        assert bm.shape[1] == (width + 31) // 32
        assert m.accept_tokens(encode(tokenizer, "{}"))
        m.fill_bitmask(bm, 0)
        toks = allowed(bm, 0)
        assert {1, 2} <= toks  # tokenizer EOS and the extra stop id
        assert not any(t >= MODEL_VOCAB for t in toks)
    finally:
        mgr.close()


def test_cache_hit_does_not_recompile(manager, backend):
    spec = make_output_spec(schema={"type": "object", "properties": {"k": {"type": "boolean"}}})
    first = manager.compile(spec, backend)
    compiles = manager.stats["compiles"]
    again = make_output_spec(schema={"properties": {"k": {"type": "boolean"}}, "type": "object"})
    assert manager.compile(again, backend) is first
    assert manager.compile_async(again, backend).result() is first
    assert manager.stats["compiles"] == compiles
    # whitespace and strict are part of the key
    assert manager.compile(make_output_spec(schema=spec.text, json_whitespace=True), backend) is not first


def test_concurrent_compiles_of_one_spec_share_work(tokenizer):
    mgr = GrammarManager(tokenizer, MODEL_VOCAB, max_workers=2)
    try:
        spec = make_output_spec(schema={"type": "array", "items": PERSON, "maxItems": 3})
        futures = [mgr.compile_async(spec) for _ in range(4)]
        results = {id(f.result(timeout=30)) for f in futures}
        assert len(results) == 1 and mgr.stats["compiles"] == 1
    finally:
        mgr.close()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"schema": {"$ref": "#/$defs/missing"}},
        {"schema": {"type": "string", "pattern": "(?=a)b"}},
        {"regex": "(?=a)b"},  # valid Python, refused by the backend ("a(b" is refused earlier, unchecked here)
        {"grammar": "start: undefined_rule"},
        {"grammar": 'root ::= "a" undefined_rule', "grammar_syntax": "ebnf"},
    ],
)
def test_bad_specs_raise_grammar_error(manager, backend, kwargs):
    fut = manager.compile_async(make_output_spec(**kwargs), backend)
    assert isinstance(fut, cf.Future)
    with pytest.raises(GrammarError) as err:
        fut.result(timeout=30)
    assert err.value.backend == backend and err.value.reason
    assert backend in str(err.value)


def test_a_regex_invalid_in_every_dialect_is_refused_before_any_backend():
    with pytest.raises(GrammarError, match="not a valid regular expression: missing \\)") as err:
        make_output_spec(regex="a(b")
    assert err.value.reason and err.value.backend is None


def test_strict_refuses_approximation(manager, backend, caplog):
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(GrammarError, match="uniqueItems"):
        manager.compile(make_output_spec(schema=schema), backend)
    with caplog.at_level(logging.WARNING):
        compiled = manager.compile(make_output_spec(schema=schema, strict=False), backend)
    assert compiled.warnings and "uniqueItems" in caplog.text


# oneOf that anyOf would approximate: integer and number branches overlap (5 matches both);
# the second hides its oneOf where only a $ref reaches it (no "definitions/<name>" schema).
OVERLAPPING_ONE_OF = [
    {"oneOf": [{"type": "integer"}, {"type": "number"}]},
    {
        "definitions": {
            "a": {"b": {"oneOf": [{"$ref": "#/definitions/c"}, {"type": "string", "maxLength": 3}]}},
            "c": {"type": "string"},
        },
        "type": "object",
        "properties": {"x": {"$ref": "#/definitions/a/b"}},
    },
]


@pytest.mark.parametrize("schema", OVERLAPPING_ONE_OF)
def test_strict_refuses_overlapping_one_of(manager, backend, schema):
    with pytest.raises(GrammarError, match="oneOf"):
        manager.compile(make_output_spec(schema=schema), backend)
    assert manager.compile(make_output_spec(schema=schema, strict=False), backend).warnings
    # Branches of disjoint types are exact either way.
    exact = {"oneOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]}
    assert not manager.compile(make_output_spec(schema=exact), backend).warnings


def test_pydantic_discriminated_union_compiles_in_both(manager, backend, tokenizer):
    from typing import Annotated, Literal

    from pydantic import BaseModel, Field

    class Cat(BaseModel):
        kind: Literal["cat"]
        lives: int

    class Dog(BaseModel):
        kind: Literal["dog"]
        good: bool

    class Pet(BaseModel):
        pet: Annotated[Cat | Dog, Field(discriminator="kind")]

    compiled = manager.compile(make_output_spec(schema=Pet), backend)
    for text, ok in (('{"pet":{"kind":"dog","good":true}}', True), ('{"pet":{"kind":"cat","good":true}}', False)):
        m = manager.new_matcher(compiled)
        accepted = m.accept_tokens(tokenizer.encode(text, add_special_tokens=False)) and m.can_end()
        assert accepted == ok, (backend, text)


def test_spec_that_matches_nothing_is_refused_at_compile(manager, backend):
    # Compiles in both engines, but no text matches it: refused when compiled (at submit),
    # not left to abort mid-batch.
    with pytest.raises(GrammarError, match="matches no text"):
        manager.compile(make_output_spec(regex=r"[^\s\S]"), backend)
    manager.compile(make_output_spec(regex="a*"), backend)  # the empty text matches: fine
    assert manager.compile(make_output_spec(schema=True), backend)  # any JSON value


def test_whitespace_flag(manager, backend, tokenizer):
    text = '{ "name" : "a",\n "age": 1 }'
    assert not run(manager, backend, tokenizer, {"schema": PERSON}, text)[0]
    assert run(manager, backend, tokenizer, {"schema": PERSON, "json_whitespace": True}, text)[0]


def test_compile_timeout_is_bounded(tokenizer, backend):
    # Deadlines count CPU time in 10 ms ticks: a compile of >= 70 ms here (llguidance needs 1000 properties)
    n = 1000 if backend == "llguidance" else 200
    big = {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]{1,20}@[a-z]{2,9}"} for i in range(n)},
    }
    mgr = GrammarManager(tokenizer, MODEL_VOCAB, default_backend=backend, max_workers=1, compile_timeout_s=1e-4)
    try:
        with pytest.raises(GrammarError, match="longer than") as err:
            mgr.compile(make_output_spec(schema=big))
        assert err.value.reason == "timeout"
    finally:
        mgr.close()


@pytest.mark.parametrize(
    "grammar,texts",
    [
        ('start: A "c"?\nA: /a|ab|abc/', ["a", "ab", "abc", "abcc", "ac"]),
        ("start: NUMBER\nNUMBER: /[0-9]+|[0-9]+\\.[0-9]+/", ["3", "3.14"]),
        ("start: NUMBER\nNUMBER: /-?[0-9]+(\\.[0-9]+)?|-?[0-9]+e[0-9]+/", ["1e5", "-2.5"]),
        ("start: ID OP ID\nOP: /<|<=|==/\nID: /[a-z]+/", ["a<=b", "a<b", "x==y"]),
        ('start: /a|aa/ "b"', ["ab", "aab"]),
    ],
    ids=["prefixes", "number", "exponent", "operator", "anonymous"],
)
def test_lark_regex_alternations_read_longest_match(manager, backend, grammar, texts):
    # Both backends read a terminal's regex as a regular language (longest match wins):
    # "3.14" is a NUMBER. Plain lark, on Python's re, takes the first alternative that
    # matches ("3") and then refuses the text; the strict check reads terminals as the
    # backends do (leftmost-longest), so these correct outputs pass.
    spec = make_output_spec(grammar=grammar)
    compiled = manager.compile(spec, backend)
    for text in texts:
        assert manager.matches(compiled, text), (backend, text)
        assert parse_output(spec, text) == (None, text)


# The README's greedy-terminal examples: (grammar, text xgrammar accepts and lark refuses,
# the same grammar written so that its terminal cannot swallow what follows, a text all take)
GREEDY_TERMINALS = [
    ('start: WORD "s"\nWORD: /[a-z]+/', "cats", "start: WORD_S\nWORD_S: /[a-z]+s/", "cats"),
    (
        'start: "x" "y"\nCOMMENT: /#[^\\n]*/\n%ignore COMMENT',
        "x#zy",
        'start: "x" "y"\nCOMMENT: /#[^\\n]*\\n/\n%ignore COMMENT',
        "x#z\ny",
    ),
]


@pytest.mark.parametrize("grammar,swallowed,fixed,text", GREEDY_TERMINALS, ids=["word", "ignored_comment"])
def test_greedy_lark_terminals(manager, grammar, swallowed, fixed, text):
    # xgrammar has no lexer: WORD may stop before the "s", the comment before the "y".
    # lark and llguidance lex greedily and refuse; strict=True reports xgrammar's output.
    spec = make_output_spec(grammar=grammar)
    assert manager.matches(manager.compile(spec, "xgrammar"), swallowed)
    assert not manager.matches(manager.compile(spec, "llguidance"), swallowed)
    with pytest.raises(OutputValidationError, match="lark package's reading"):
        parse_output(spec, swallowed)
    spec = make_output_spec(grammar=fixed)
    for backend in ("llguidance", "xgrammar"):
        assert manager.matches(manager.compile(spec, backend), text), backend
    assert parse_output(spec, text) == (None, text)


def test_xgrammar_eager_masks_option(tokenizer):
    mgr = GrammarManager(
        tokenizer,
        MODEL_VOCAB,
        default_backend="xgrammar",
        max_workers=1,
        backend_options={"xgrammar": {"lazy_masks": False}},
    )
    try:
        m = mgr.new_matcher(mgr.compile(make_output_spec(schema=PERSON)))
        assert m.accept_tokens(encode(tokenizer, '{"name":"a","age":1}')) and m.can_end()
    finally:
        mgr.close()


def test_unknown_backend(manager):
    with pytest.raises(GrammarError, match="unknown grammar backend"):
        manager.compile(make_output_spec(regex="a"), "outlines")


@pytest.mark.parametrize(
    "pattern, yes, no",
    [
        ("^\\W+$", ["é", "٣", "!"], ["a", "_", "5"]),
        ("^\\D+$", ["é", "٣", "a"], ["5"]),
        ("^[^\\w]+$", ["é", " "], ["a"]),
        ("^[a\\D]+$", ["a٣"], ["a5"]),
    ],
)
def test_schema_patterns_read_w_and_d_as_ecma_262_in_both(manager, backend, pattern, yes, no):
    """A JSON Schema pattern is ECMA-262, whose \\w and \\d are ASCII: their complements take
    "é" and "٣". Both backends read it so, so xgrammar is no longer refused these under strict
    (only a regex= spec, which means Python's Unicode \\w, is), and the final check agrees."""
    from constrained_serve.grammar import parse_output

    spec = make_output_spec(schema={"type": "string", "pattern": pattern})
    compiled = manager.compile(spec, backend)
    assert not compiled.warnings
    for text in yes:
        assert manager.matches(compiled, json.dumps(text, ensure_ascii=False)), (pattern, text)
        assert parse_output(spec, json.dumps(text, ensure_ascii=False))[0] == text
    for text in no:
        assert not manager.matches(compiled, json.dumps(text)), (pattern, text)


@pytest.mark.parametrize("variant", ["legacy", "metaspace"])
def test_forced_tokens_with_a_sentencepiece_tokenizer(sentencepiece_model_dirs, variant):
    """A SentencePiece tokenizer reads a text as the start of a text ("▁{"): xgrammar's forced
    string is tokenized as it reads mid-output, so both backends force the same tokens (it
    used to force nothing) and they read back as the grammar's text."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(sentencepiece_model_dirs[variant]))
    forced = {}
    for name in ("llguidance", "xgrammar"):
        gm = GrammarManager(tok, len(tok), eos_token_ids=[tok.eos_token_id])
        m = gm.new_matcher(gm.compile(make_output_spec(schema=PERSON), name))
        forced[name] = m.forced_tokens()
        assert m.accept_tokens(forced[name])
        gm.close()
    assert tok.decode([tok.bos_token_id] + forced["xgrammar"], skip_special_tokens=True).startswith('{"name":')
    assert forced["xgrammar"] and forced["xgrammar"] == forced["llguidance"][: len(forced["xgrammar"])]
    assert "▁" not in tok.convert_ids_to_tokens(forced["xgrammar"])[0]


def test_xgrammar_special_tokens_are_not_text(manager, tokenizer):
    """xgrammar took a special token for its literal text ("<|im_start|>" inside a string or a
    "[^b]" class; EOS as text let "[^b]+" end empty), which the Result then leaves out. Now
    no special token but EOS is ever allowed, and EOS only where the regex may end."""
    specials = [i for i in tokenizer.all_special_ids if i != EOS]
    bitmask = manager.allocate_bitmask(1)
    for spec, prefix in ((make_output_spec(regex="[^b]+"), ""), (make_output_spec(schema=PERSON), '{"name":"')):
        m = manager.new_matcher(manager.compile(spec, "xgrammar"))
        assert not prefix or m.accept_tokens(encode(tokenizer, prefix))
        manager.fill_bitmask([(0, m)], bitmask)
        ok = allowed(bitmask, 0)
        assert not ok & set(specials), spec
        assert (EOS in ok) == m.can_end()
    m = manager.new_matcher(manager.compile(make_output_spec(regex="[^b]+"), "xgrammar"))
    assert not m.accept_tokens([EOS]) and not m.can_end()


@pytest.mark.parametrize(
    "grammar,line,col",
    [
        ("start: A B\nA: /a+\n", 2, 4),
        ('start: A B\nA: "a\n', 2, 4),
        ("\n\n\nstart: A B\nA: /a+\n", 5, 4),
    ],
)
def test_lark_syntax_errors_point_at_their_line(manager, backend, grammar, line, col):
    with pytest.raises(GrammarError) as e:
        manager.compile(make_output_spec(grammar=grammar), backend)
    assert f"line {line}, column {col}" in str(e.value), str(e.value)


def test_prefilled_masks_are_used_while_fresh_and_refilled_when_stale(manager, backend, tokenizer):
    """prefill_masks fills the next step's rows ahead; a step's fill copies a prefilled row
    only if nothing touched its matcher since and no later prefill reused the slots, and
    the rows it gives equal fresh fills (of twin matchers with the same history)."""
    compiled = manager.compile(make_output_spec(schema=PERSON), backend)
    texts = ['{"name":"', '{"name":"Al","age":', ""]

    def matchers():
        ms = [manager.new_matcher(compiled) for _ in texts]
        for m, text in zip(ms, texts):
            assert not text or m.accept_tokens(encode(tokenizer, text))
        return ms

    def fresh():
        bm = manager.allocate_bitmask(len(texts))
        manager.fill_bitmask(list(enumerate(matchers())), bm)
        return bm

    a, b, c = matchers()
    expected = fresh()
    used = manager.stats["prefilled_rows"]
    manager.prefill_masks([a, b, c])
    # The step's rows are in another order than the prefill's slots.
    bm = manager.step_bitmask(3)
    manager.fill_bitmask([(0, c), (1, a), (2, b)], bm)
    assert manager.stats["prefilled_rows"] == used + 3
    assert torch.equal(bm, expected[[2, 0, 1]])

    # Stale: a accepts tokens after its prefill; a later prefill (of b only) retires c's slot.
    manager.prefill_masks([a, c])
    assert a.accept_tokens(encode(tokenizer, "Al"))
    texts[0] += "Al"
    manager.prefill_masks([b])
    expected = fresh()
    used = manager.stats["prefilled_rows"]
    bm = manager.step_bitmask(3)
    manager.fill_bitmask([(0, a), (1, b), (2, c)], bm)
    assert manager.stats["prefilled_rows"] == used + 1  # b only
    assert torch.equal(bm, expected)
    assert not torch.equal(bm[0], bm[2])  # a moved on: its old mask was c's


def test_a_fill_of_prefilled_rows_waits_for_the_prefill_only_in_wait(manager, backend, tokenizer):
    """When every row of a step is in the prefill still running, fill_bitmask_async returns
    at once (the engine starts the forward) and wait() collects the prefill and copies the
    rows; a row that was not prefilled makes it collect the prefill first, as before."""
    compiled = manager.compile(make_output_spec(schema=PERSON), backend)
    a, b = manager.new_matcher(compiled), manager.new_matcher(compiled)
    assert b.accept_tokens(encode(tokenizer, '{"name":"'))
    expected = manager.allocate_bitmask(2)
    manager.fill_bitmask([(0, a), (1, b)], expected)

    manager.prefill_masks([a, b])
    bm = manager.step_bitmask(2)
    pending = manager.fill_bitmask_async([(0, b), (1, a)], bm)
    assert manager.masks.prefill_in_flight  # not collected yet: the forward runs meanwhile
    assert pending.wait() == []
    assert not manager.masks.prefill_in_flight
    assert torch.equal(bm, expected[[1, 0]])

    c = manager.new_matcher(compiled)  # never prefilled
    manager.prefill_masks([a])
    pending = manager.fill_bitmask_async([(0, a), (1, c)], manager.step_bitmask(2))
    assert not manager.masks.prefill_in_flight
    pending.wait()
