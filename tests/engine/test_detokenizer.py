"""Incremental detokenization is exact for multi-byte characters."""

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
