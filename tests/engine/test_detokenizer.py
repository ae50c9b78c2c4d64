"""Incremental detokenization is exact for multi-byte characters; cut_at_stop holds back the
text a stop string may still begin in."""

from constrained_serve.engine.detokenizer import IncrementalDetokenizer

from ..helpers import subprocess_env

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
    from constrained_serve.engine.detokenizer import cut_at_stop

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


def test_batch_decoder_decodes_like_the_tokenizer_and_starts_no_thread_pool(default_tokenizer):
    """The engine decodes every row of a step in one call. The texts are the tokenizer's own
    (special tokens skipped), and the call starts no thread pool: the Rust tokenizer's
    ``decode_batch`` would start one per core unless TOKENIZERS_PARALLELISM says no, and its
    threads spin on the cores the mask workers and the forward need."""
    import os
    import subprocess
    import sys
    import textwrap

    from constrained_serve.engine.detokenizer import batch_decoder

    tok = default_tokenizer
    seqs = [tok.encode(t, add_special_tokens=False) for t in TEXTS] + [[tok.eos_token_id], []]
    seqs.append(seqs[0][:3] + [tok.eos_token_id] + seqs[1][:2])
    assert batch_decoder(tok)(seqs) == [
        tok.decode(s, skip_special_tokens=True, clean_up_tokenization_spaces=False) for s in seqs
    ]
    # In a fresh process with parallelism left at the tokenizers' default (on): the thread
    # count before and after a step's worth of decoding.
    script = textwrap.dedent(
        f"""
        import os
        from transformers import AutoTokenizer
        from constrained_serve.engine.detokenizer import batch_decoder
        tok = AutoTokenizer.from_pretrained({tok.name_or_path!r})
        decode = batch_decoder(tok)
        before = len(os.listdir("/proc/self/task"))
        for _ in range(3):
            decode([[100 + i, 200 + i, 300] for i in range(512)])
        print(before, len(os.listdir("/proc/self/task")))
        """
    )
    env = subprocess_env()
    env.pop("TOKENIZERS_PARALLELISM", None)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after = map(int, out.stdout.split()[-2:])
    assert after == before, f"decoding started {after - before} threads (os.cpu_count()={os.cpu_count()})"
