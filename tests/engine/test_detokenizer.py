"""Incremental detokenization is exact for multi-byte characters; cut_at_stop holds back the
text a stop string may still begin in."""

from constrained_serve.detokenizer import IncrementalDetokenizer

TEXTS = ["Grüße aus Köln — 東京タワー 🚀🎉 naïve café", "emoji: 👩‍👩‍👧 done", "  leading spaces\n\ttabs"]


def test_token_by_token_equals_full_decode(default_tokenizer):
    for text in TEXTS:
        ids = default_tokenizer(text, add_special_tokens=False)["input_ids"]
        d = IncrementalDetokenizer(default_tokenizer)
        pieces = [d.push([t]) for t in ids]
        pieces.append(d.flush())
        assert "".join(pieces) == default_tokenizer.decode(ids)
        assert all("\ufffd" not in p for p in pieces)


def test_cut_at_stop_holds_back_a_possible_stop_start():
    from constrained_serve.detokenizer import cut_at_stop

    assert cut_at_stop("Hello. World", ["."], final=False) == "Hello"
    assert cut_at_stop("abc s ar", ["s are"], final=False) == "abc "  # "s ar" may become "s are"
    assert cut_at_stop("abc s ar", ["s are"], final=True) == "abc s ar"
    assert cut_at_stop("x END y END", ["END", "y"], final=True) == "x "  # the earliest stop wins
    assert cut_at_stop("plain", [], final=False) == "plain"


def test_restore_takes_back_pushed_tokens_even_mid_character(default_tokenizer):
    """The engine detokenizes a step's tokens while their grammars advance, and takes a
    token back if its grammar work failed: the text goes on as if it was never pushed."""
    tok = default_tokenizer
    ids = tok.encode("naïve café 🙂 done", add_special_tokens=False)
    for cut in range(1, len(ids)):
        d = IncrementalDetokenizer(tok)
        d.push(ids[:cut])
        mark = d.mark()
        d.push([ids[cut]])
        d.push(tok.encode(" wrong", add_special_tokens=False))
        d.restore(mark)
        d.push(ids[cut:])
        d.flush()
        assert d.text == tok.decode(ids), cut
