"""Radix prefix cache in the engine: random workloads, shared prefixes, multi-turn append."""
import random

import pytest

from constrained_serve import Engine, SamplingParams
from constrained_serve.conversation import send_many


def _random_workload(seed, tok, n=14):
    rng = random.Random(seed)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()
    prefixes = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 60))) for _ in range(3)]
    prompts = []
    for _ in range(n):
        p = rng.choice(prefixes) if rng.random() < 0.8 else ""
        prompts.append(p + " " + " ".join(rng.choice(words) for _ in range(rng.randint(1, 25))))
    return prompts, [rng.randint(1, 12) for _ in range(n)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workloads_match_cache_off(tiny_engine_factory, seed):
    """Small pools force eviction and preemption; integrity holds after every step."""
    on = tiny_engine_factory(kv_cache_tokens=512, max_num_batched_tokens=48, max_num_seqs=6)
    off = tiny_engine_factory(kv_cache_tokens=512, max_num_batched_tokens=48, max_num_seqs=6,
                              enable_prefix_cache=False)
    on.core.check_each_step = True
    off.core.check_each_step = True
    prompts, lens = _random_workload(seed, on.tokenizer)
    # Two waves: the second reuses what the first left in the cache.
    for wave in range(2):
        for eng in (on, off):
            eng._out = [r.token_ids for r in eng.generate(
                prompts, SamplingParams(max_tokens=max(lens) + wave, ignore_eos=True))]
        assert on._out == off._out
    assert sum(r for r in [on.kv.radix.cached_pages()]) > 0
    # Evicting everything leaves the pool entirely free.
    on.kv.radix.evict(on.pool.num_pages)
    assert on.pool.num_free == on.pool.num_pages


def test_shared_prefix_is_computed_once(tiny_engine_factory):
    instruction = "Extract the fields of the following text as JSON. " * 20
    prompts = [instruction + f"Text number {i}: something happened." for i in range(12)]
    p = SamplingParams(max_tokens=4, ignore_eos=True)
    off = tiny_engine_factory(enable_prefix_cache=False)
    off.generate(prompts, p)
    on = tiny_engine_factory()
    on.core.check_each_step = True
    res = on.generate(prompts, p)  # all at once: in-batch sharing, not only across batches
    n_prefix = len(on.encode_prompt(instruction)) // 16 * 16
    computed_off = off.core.runner.tokens_computed
    computed_on = on.core.runner.tokens_computed
    assert computed_off - computed_on >= 11 * (n_prefix - 16)
    assert all(r.usage.cached_tokens >= n_prefix - 16 for r in res[1:])
    assert res[0].usage.cached_tokens == 0


def test_prefix_ending_mid_page_is_reused_to_the_token(tiny_engine_factory):
    """The common prefix ends inside a page: its leading slots are copied (copy on write) and
    only the rest is computed; outputs match the cache-off engine token for token."""
    on = tiny_engine_factory()
    on.core.check_each_step = True
    off = tiny_engine_factory(enable_prefix_cache=False)
    base = on.encode_prompt("Extract the fields of the following text as JSON. " * 8)
    common = 3 * 16 + 7  # 7 tokens into a page
    assert len(base) > common
    prompts = [base[:common] + [100 + i, 200 + i, 300 + i] + base[:20] for i in range(6)]  # page 4 full
    p = SamplingParams(max_tokens=3, ignore_eos=True)
    ref = [r.token_ids for r in off.generate(prompts, p)]
    res = on.generate(prompts, p)
    assert [r.token_ids for r in res] == ref
    assert [r.usage.cached_tokens for r in res] == [0] + [common] * 5
    # First request: whole prompt; others: the 23 tokens after the common prefix; 2 decode steps each.
    assert on.core.runner.tokens_computed == len(prompts[0]) + 5 * (len(prompts[0]) - common) + 6 * 2


def test_cached_tokens_count_the_admission_that_happened(tiny_engine_factory):
    """usage.cached_tokens is what the request's real admission reused: not the match of an
    attempt that waited (for a twin computing the same page: it then reused more), nor of
    one that found no room (the prefix was evicted before it ran)."""
    eng = tiny_engine_factory(kv_cache_tokens=4096, page_size=4)
    eng.core.check_each_step = True
    head = list(range(3000, 3020))  # 5 pages
    eng.generate([head + [1, 2]], SamplingParams(max_tokens=1))
    prompt = head + list(range(4000, 4030))
    before = eng.core.runner.tokens_computed
    a, b = eng.generate([prompt, prompt], SamplingParams(max_tokens=1))
    assert eng.core.runner.tokens_computed - before == 30 + 2
    assert (a.usage.cached_tokens, b.usage.cached_tokens) == (20, 48)

    eng = tiny_engine_factory(kv_cache_tokens=64, page_size=4, max_num_seqs=4)
    eng.core.check_each_step = True
    head = list(range(3000, 3032))  # 8 of the pool's 16 pages
    eng.generate([head + [7]], SamplingParams(max_tokens=1))
    big, x = list(range(5000, 5036)), head + list(range(6000, 6008))
    before = eng.core.runner.tokens_computed
    _, rx = eng.generate([big, x], [SamplingParams(max_tokens=28, ignore_eos=True), SamplingParams(max_tokens=1)])
    assert eng.core.runner.tokens_computed - before == 36 + 27 + 40  # x computed in full
    assert rx.usage.cached_tokens == 0


def test_a_page_completed_by_decoding_is_shared_at_once(tiny_engine_factory):
    """A prompt that extends a running request's prompt and output waits at most a step for
    the page being written, not for that request to finish (decoded pages used to be
    published only at its end)."""
    ref = tiny_engine_factory(enable_prefix_cache=False)
    first = list(range(1000, 1010))  # ends inside a page
    [a] = ref.generate([first], SamplingParams(max_tokens=60, ignore_eos=True))
    second = first + a.token_ids[:6] + [555, 556, 557]
    [alone] = ref.generate([second], SamplingParams(max_tokens=3, ignore_eos=True))
    eng = tiny_engine_factory(page_size=4)
    eng.core.check_each_step = True
    ra = eng._new_request(first, SamplingParams(max_tokens=60, ignore_eos=True), None, 0, None)
    eng.core.add(ra)
    for _ in range(7):  # prefill, then 6 decoded tokens
        eng.core.step()
    rb = eng._new_request(second, SamplingParams(max_tokens=3, ignore_eos=True), None, 1, None)
    eng.core.add(rb)
    steps = 0
    while not rb.finished:
        eng.core.step()
        steps += 1
    assert steps <= 4 and not ra.finished
    assert rb.output_ids == alone.token_ids and rb.num_cached >= 12


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
        assert fresh.generate([last_prompt], p)[0].token_ids == c.token_ids[len(last_prompt):-1]
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
    for params in (SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop_str]),
                   SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=[word])):
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
        return ids[len(ids) - ids[::-1].index(eos):]

    with eng.conversation() as conv:
        conv.send("say more", SamplingParams(max_tokens=4, ignore_eos=True))  # computed and cached
        # "wo" ends inside the token "▁world" (or "▁wor"): the rest is tokenized afresh.
        prompt = conv.next_turn_ids("the cat")
        r = conv.send("the cat", SamplingParams(max_tokens=4, stop=["rld"]), choices=["hello world"])
        assert r.text == "hello wo" and r.stop_reason == "rld"
        said = conv.token_ids[len(prompt):-1]
        assert conv.token_ids[-1] == eos
        assert tok.decode(prompt[-4:] + said) == tok.decode(prompt[-4:]) + "hello wo"
        new = conv.next_turn_ids("a dog")
        full = tok(eng.render_chat(conv.history + [{"role": "user", "content": "a dog"}]),
                   add_special_tokens=False)["input_ids"]
        assert new[:len(conv.token_ids)] == conv.token_ids
        assert new[len(conv.token_ids):] == after_last_eos(full)
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
    t = threading.Thread(target=lambda: done.append(conv.send("first", SamplingParams(max_tokens=200,
                                                                                      ignore_eos=True))))
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
