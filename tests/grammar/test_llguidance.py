"""llguidance's lexer limits (grammar/llguidance.py): a spec whose first masks need much lexer
work decodes, and one llguidance cannot lex at its first mask is refused at submit."""

from __future__ import annotations

import pytest

from constrained_serve.errors import GrammarError
from constrained_serve.grammar import GrammarManager, make_output_spec
from constrained_serve.grammar import llguidance as llg_backend

from .conftest import MODEL_VOCAB

# Cue words of three kinds of message, as a demo schema tried them: the evidence string is
# free text around one of the words, and each anyOf branch allows its own words.
PHRASES = [
    "invoice|bill|statement|total|total due|amount due|payment terms|please pay|payable|balance",
    "how do I|how can I|can I|can you|could you|please|I'd like|I would like|change|cancel|update|question",
    "error|problem|bug|broken|crash|crashes|can't|cannot|won't|doesn't work|not working|failed|wrong|missing|"
    "lost|late|never|down|refund|damaged|urgent|help|need|fix|order|delivery|account|password|address|plan|"
    "subscription|login|app|package|payment",
]


def cue_pattern(phrases: str) -> str:
    """Up to 20 characters, one of the phrases (capitalised or in capitals), up to 20 more."""
    alts = "|".join(f"[{w[0].upper()}{w[0].lower()}]{w[1:]}|{w.upper()}" for w in phrases.split("|"))
    return '^([^"\\\\]{0,20} )?(' + alts + ')([ ,.!?:;][^"\\\\]{0,20})?$'


# With maxLength on the string, its first mask builds the lexer states of every branch at
# once: between 200k (llguidance's default fuel, not enough) and 500k of its lexer fuel.
SCHEMA = {
    "type": "object",
    "properties": {"evidence": {"type": "string", "maxLength": 60}, "kind": {"type": "integer"}},
    "required": ["evidence", "kind"],
    "additionalProperties": False,
    "anyOf": [
        {"properties": {"evidence": {"pattern": cue_pattern(p)}, "kind": {"const": i}}} for i, p in enumerate(PHRASES)
    ],
}


def test_a_spec_whose_first_masks_need_much_lexer_work_decodes(manager, tokenizer):
    """It failed mid-decoding with "lexer error: too many expressions constructed"."""
    m = manager.new_matcher(manager.compile(make_output_spec(schema=SCHEMA), "llguidance"))
    bm = manager.allocate_bitmask(1)
    ids = tokenizer.encode('{"evidence":"I can\'t log in to my account","kind":2}', add_special_tokens=False)
    for t in ids:
        m.fill_bitmask(bm, 0)
        assert m.failure is None
        assert (int(bm[0, t // 32]) >> (t % 32)) & 1, tokenizer.decode([t])
        assert m.accept_tokens([t])
    assert m.can_end()
    wrong_kind = tokenizer.encode('{"evidence":"I can\'t log in","kind":0}', add_special_tokens=False)
    assert not manager.new_matcher(manager.compile(make_output_spec(schema=SCHEMA), "llguidance")).accept_tokens(
        wrong_kind
    )


def test_a_spec_llguidance_cannot_lex_at_its_first_mask_fails_at_submit(tokenizer, monkeypatch):
    """With llguidance's own default fuel the same schema cannot be lexed: that is found at
    compile time (the submit), not by a request mid-batch."""
    monkeypatch.setattr(llg_backend, "STEP_LEXER_FUEL", 200_000)
    mgr = GrammarManager(tokenizer, MODEL_VOCAB, default_backend="llguidance", isolation="inline")
    try:
        with pytest.raises(GrammarError, match="cannot compute the first token masks.*too many expressions"):
            mgr.compile(make_output_spec(schema=SCHEMA))
        mgr.compile(make_output_spec(schema={**SCHEMA, "anyOf": SCHEMA["anyOf"][:1]}))  # one branch: fine
    finally:
        mgr.close()


def test_accept_sampled_walks_the_same_states_as_accept_tokens(tokenizer):
    """The worker's advance takes a step's sampled token with accept_sampled (llguidance's
    consume_token, cheaper than the try_consume_tokens of accept_tokens): along random walks
    through a schema, drawn from the masks, both give the same masks and end states, EOS
    included; a token the mask refuses is refused, with the backend's error."""
    import random

    import numpy as np

    from constrained_serve.grammar.base import allocate_bitmask, allowed_tokens
    from constrained_serve.grammar.tokenizer_data import TokenizerData

    schema = {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "tags": {"type": "array", "items": {"enum": ["a", "bc"]}}},
        "required": ["id", "tags"],
        "additionalProperties": False,
    }
    backend = llg_backend.LLGuidanceBackend(TokenizerData.from_hf(tokenizer, MODEL_VOCAB))
    compiled = backend.compile(make_output_spec(schema=schema))
    eos = tokenizer.eos_token_id
    bm = allocate_bitmask(2, MODEL_VOCAB)
    for seed in range(6):
        rng = random.Random(seed)
        fast, checked = backend.new_matcher(compiled), backend.new_matcher(compiled)
        for _ in range(60):
            fast.fill_bitmask(bm, 0)
            checked.fill_bitmask(bm, 1)
            assert np.array_equal(bm[0], bm[1])
            allowed = np.flatnonzero(allowed_tokens(bm[0], MODEL_VOCAB)).tolist()
            # Favour EOS where it is allowed, so every walk ends through it.
            t = eos if eos in allowed and rng.random() < 0.5 else rng.choice(allowed)
            assert fast.accept_sampled(t) and checked.accept_tokens([t])
            assert (fast.is_finished(), fast.can_end()) == (checked.is_finished(), checked.can_end())
            if t == eos:
                break
        assert t == eos, f"walk {seed} did not end"
    m = backend.new_matcher(compiled)
    refused = tokenizer.encode("x", add_special_tokens=False)[0]  # an object starts with "{"
    assert not m.accept_sampled(refused)
    assert m.error() is not None


def test_fill_bitmask_checks_each_new_bitmask_and_every_row(tokenizer):
    """fill_bitmask remembers where the last bitmask's rows lie (a mask worker fills the same
    one 256 times a step): the bits equal llguidance's own fill, a row past the array is
    refused rather than written, and any other array is checked again before it is used."""
    import numpy as np
    from llguidance.numpy import fill_next_token_bitmask

    from constrained_serve.grammar.base import allocate_bitmask
    from constrained_serve.grammar.tokenizer_data import TokenizerData

    backend = llg_backend.LLGuidanceBackend(TokenizerData.from_hf(tokenizer, MODEL_VOCAB))
    m = backend.new_matcher(backend.compile(make_output_spec(regex=r"[a-c]{2}x")))
    bm = allocate_bitmask(3, MODEL_VOCAB)
    m.fill_bitmask(bm, 2)
    want = np.full_like(bm[:1], -1)
    fill_next_token_bitmask(m.raw, want, 0)
    assert np.array_equal(bm[2], want[0]) and (bm[:2] == -1).all()
    for row in (3, -1):
        with pytest.raises(IndexError, match="out of range"):
            m.fill_bitmask(bm, row)
    assert (bm[:2] == -1).all()
    with pytest.raises(ValueError, match="int32"):
        m.fill_bitmask(bm.astype(np.int64), 0)
    with pytest.raises(ValueError, match="contiguous"):
        m.fill_bitmask(np.asfortranarray(allocate_bitmask(3, MODEL_VOCAB)), 0)
    other = allocate_bitmask(1, MODEL_VOCAB)
    m.fill_bitmask(other, 0)  # a new array: its own address and rows
    assert np.array_equal(other[0], want[0])
    with pytest.raises(IndexError):
        m.fill_bitmask(other, 1)
