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
