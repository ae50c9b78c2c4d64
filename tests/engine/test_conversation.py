"""Multi-turn conversations: turns append to the cached KV, histories are pinned while
open (within their share of the pool) and given way when a request could not run otherwise."""

import pytest

from constrained_serve import Engine, SamplingParams
from constrained_serve.conversation import send_many


def test_conversation_appends_and_releases(tiny_engine_factory):
    eng = tiny_engine_factory()
    eng.core.check_each_step = True
    p = SamplingParams(max_tokens=6, ignore_eos=True)
    with eng.conversation(system="You are terse.") as conv:
        r1 = conv.send("Hello there, how are you today?", p)
        hist = list(conv.token_ids)
        before = eng.core.runner.tokens_computed
        r2 = conv.send("And tomorrow?", p)
        new_tokens = len(conv.token_ids) - len(hist) - len(r2.token_ids) - 1  # minus closing eos
        assert conv.token_ids[: len(hist)] == hist  # history never re-tokenized
        assert r2.usage.cached_tokens >= (len(hist) - 1) // 16 * 16
        assert eng.core.runner.tokens_computed - before <= (len(hist) - r2.usage.cached_tokens) + new_tokens + 6
        assert len(conv.history) == 5 and conv.history[-1]["content"] == r2.text
        assert conv.pages  # history pinned while open
        eng.core.check_integrity()
    assert not conv.pages and conv.closed
    eng.core.check_integrity()
    assert r1.finish_reason == "length"


def test_many_conversations_in_one_batch(tiny_engine_factory):
    eng = tiny_engine_factory()
    eng.core.check_each_step = True
    convs = [eng.conversation(system=f"System {i}") for i in range(5)]
    p = SamplingParams(max_tokens=5, ignore_eos=True)
    for turn in range(3):
        rs = send_many(convs, [f"turn {turn} of conversation {i}" for i in range(5)], p)
        assert all(r.finish_reason == "length" for r in rs)
        if turn:
            assert all(r.usage.cached_tokens > 0 for r in rs)
    # Same outputs as re-running each full history from scratch without a cache.
    fresh = tiny_engine_factory(enable_prefix_cache=False)
    for c in convs:
        last_prompt = c.token_ids[: len(c.token_ids) - 6]
        assert fresh.generate([last_prompt], p)[0].token_ids == c.token_ids[len(last_prompt) : -1]
        c.close()
    eng.core.check_integrity()


def test_pins_survive_ordinary_memory_pressure(tiny_engine_factory):
    """More work than the pool holds is handled by preempting runners and queueing; the
    conversations' pins stay (they go only when a request could not run at all)."""
    eng = tiny_engine_factory(kv_cache_tokens=512, page_size=16)  # 32 pages; pins may take 16
    eng.core.check_each_step = True
    conv = eng.conversation(system="You are a storyteller. " * 3)
    conv.send("Tell a long story.", SamplingParams(max_tokens=40, ignore_eos=True))
    pinned = list(conv.pages)
    assert pinned
    prompts = [eng.encode_prompt(f"story {i} " * 20)[:60] for i in range(10)]
    rs = eng.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
    assert all(r.error is None and len(r.token_ids) == 40 for r in rs)
    assert eng.core.scheduler.num_preemptions > 0 and conv.pages == pinned
    conv.close()


def test_conversation_history_is_the_text_a_stop_left(tiny_engine_factory):
    """After a stop string (ending inside a token) or a stop token, the conversation goes on
    from the text the user saw, not from the tokens the model wrote past it."""
    eng = tiny_engine_factory()
    with eng.conversation() as conv:
        free = conv.send("hi", SamplingParams(max_tokens=12, ignore_eos=True))
    tok = eng.tokenizer
    word = next(t for t in free.token_ids[3:] if len(tok.decode([t]).strip()) >= 3)
    stop_str = tok.decode([word]).strip()[1:3]  # ends inside that token
    end = tok.decode([tok.eos_token_id])
    for params in (
        SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop_str]),
        SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=[word]),
    ):
        with eng.conversation() as conv:
            r = conv.send("hi", params)
            assert r.stop_reason is not None and conv.history[-1]["content"] == r.text
            assert tok.decode(conv.token_ids).endswith("assistant\n" + r.text + end)
            r2 = conv.send("more", SamplingParams(max_tokens=3, ignore_eos=True))
            assert r2.error is None and len(conv.history) == 4


@pytest.mark.parametrize("variant", ["legacy", "metaspace"])
def test_conversation_with_a_sentencepiece_tokenizer(sentencepiece_model_dirs, variant):
    """A new turn is tokenized as it stands in the whole rendered conversation (after the
    end-of-turn token), and the tail a stop string left is tokenized to read exactly as the
    text the user saw: no "▁" a SentencePiece tokenizer adds at the start of a text."""
    eng = Engine(model=str(sentencepiece_model_dirs[variant]), kv_cache_tokens=2048, page_size=4)
    tok, eos = eng.tokenizer, eng.tokenizer.eos_token_id

    def after_last_eos(ids):
        return ids[len(ids) - ids[::-1].index(eos) :]

    with eng.conversation() as conv:
        conv.send("say more", SamplingParams(max_tokens=4, ignore_eos=True))  # computed and cached
        # "wo" ends inside the token "▁world" (or "▁wor"): the rest is tokenized afresh.
        prompt = conv.next_turn_ids("the cat")
        r = conv.send("the cat", SamplingParams(max_tokens=4, stop=["rld"]), choices=["hello world"])
        assert r.text == "hello wo" and r.stop_reason == "rld"
        said = conv.token_ids[len(prompt) : -1]
        assert conv.token_ids[-1] == eos
        assert tok.decode(prompt[-4:] + said) == tok.decode(prompt[-4:]) + "hello wo"
        new = conv.next_turn_ids("a dog")
        full = tok(eng.render_chat(conv.history + [{"role": "user", "content": "a dog"}]), add_special_tokens=False)[
            "input_ids"
        ]
        assert new[: len(conv.token_ids)] == conv.token_ids
        assert new[len(conv.token_ids) :] == after_last_eos(full)
        r3 = conv.send("a dog", SamplingParams(max_tokens=3, ignore_eos=True))
        assert r3.error is None and r3.usage.cached_tokens > 0


def test_a_second_turn_in_flight_is_refused(tiny_engine_factory):
    """Two threads sending on one conversation would each build on the old history and the
    second commit would drop the first turn's tokens: the second send is refused instead."""
    import threading
    import time

    eng = tiny_engine_factory()
    conv = eng.conversation()
    done = []
    t = threading.Thread(
        target=lambda: done.append(conv.send("first", SamplingParams(max_tokens=200, ignore_eos=True)))
    )
    t.start()
    while not eng.core.has_work() and t.is_alive():  # the first turn is running
        time.sleep(0.001)
    with pytest.raises(RuntimeError, match="already has a turn in flight"):
        conv.send("second", SamplingParams(max_tokens=3))
    t.join()
    assert [m["content"] for m in conv.history if m["role"] == "user"] == ["first"]
    assert "first" in eng.tokenizer.decode(conv.token_ids) and done[0].error is None
    conv.send("second", SamplingParams(max_tokens=3))  # one at a time is fine
    conv.close()


def test_conversation_pin_limit_falls_back(tiny_engine_factory):
    eng = tiny_engine_factory(conversation_lock_fraction=0.0)
    conv = eng.conversation()
    r1 = conv.send("hello " * 40, SamplingParams(max_tokens=3, ignore_eos=True))
    assert not conv.pages  # over the share: not pinned, still works
    r2 = conv.send("again", SamplingParams(max_tokens=3, ignore_eos=True))
    assert r1.error is None and r2.error is None
    conv.close()


def test_pinned_history_gives_way_to_a_request_that_fits(tiny_engine_factory):
    """An open conversation's pin must never make a request under max_model_len fail: when
    the pool runs out, pins are dropped, and the conversation recomputes what was evicted."""
    eng = tiny_engine_factory(kv_cache_tokens=256, page_size=16)  # 16 pages; pins may take 8
    eng.core.check_each_step = True
    p = SamplingParams(max_tokens=40, ignore_eos=True)
    conv = eng.conversation(system="You are a storyteller. " * 3)
    conv.send("Tell a long story.", p)
    assert len(conv.pages) >= 4
    ids = eng.encode_prompt("hello " * 250)[:200]
    [r] = eng.generate([ids], SamplingParams(max_tokens=50, ignore_eos=True))
    assert r.error is None and r.finish_reason == "length" and len(r.token_ids) == 50
    fresh = tiny_engine_factory(enable_prefix_cache=False)
    assert fresh.generate([ids], SamplingParams(max_tokens=50, ignore_eos=True))[0].token_ids == r.token_ids
    r2 = conv.send("Go on.", SamplingParams(max_tokens=5, ignore_eos=True))
    last_prompt = conv.token_ids[: len(conv.token_ids) - 6]
    assert r2.error is None
    assert fresh.generate([last_prompt], SamplingParams(max_tokens=5, ignore_eos=True))[0].token_ids == r2.token_ids
    assert conv.pages  # pinned again at its turn
    conv.close()
    eng.core.check_integrity()


@pytest.mark.slow
def test_three_turn_conversation_default_model(default_engine):
    eng = default_engine
    p = SamplingParams(max_tokens=24)
    conv = eng.conversation(system="You are a helpful assistant. Answer in one short sentence.")
    r1 = conv.send("What is the capital of France?", p)
    assert "Paris" in r1.text
    for msg in ["And of Germany?", "And of Italy?"]:
        hist = len(conv.token_ids)
        before = eng.core.runner.tokens_computed
        r = conv.send(msg, p)
        prompt_new = r.usage.prompt_tokens - hist
        assert r.usage.cached_tokens >= (hist - 1) // 16 * 16
        # Prefill computed only the tail of the history (< one page) and the new turn.
        prefilled = eng.core.runner.tokens_computed - before - (r.usage.completion_tokens - 1)
        assert prefilled <= prompt_new + 16
    assert "Rome" in r.text or "Italy" in r.text
    conv.close()
