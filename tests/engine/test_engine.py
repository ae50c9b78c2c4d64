"""The engine's step loop: continuous batching, chunked prefill and preemption never change
greedy outputs; decodes are never stalled by a long prefill; prompts too long are refused.
The radix prefix cache in the loop: random workloads equal the cache-off engine, shared
prefixes are computed once, partial pages are reused to the token."""

import random

import pytest

from constrained_serve import Engine, SamplingParams

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "1, 2, 3, 4, 5,",
    "Question: what is the boiling point of water at sea level?\nAnswer:",
    "def add(a, b):\n    return",
    "In the beginning God created the heaven and the earth. And the earth was without form, "
    "and void; and darkness was upon the face of the deep. And the Spirit of God moved upon",
    "Paris is the capital of",
    "A long time ago in a galaxy far, far away, there was a small robot who loved to read books "
    "about the history of the universe, the stars, the planets and the people who lived on them. One day",
    "Roses are red,",
]


def _run(engine, prompts, max_tokens=12):
    engine.core.check_each_step = True
    return [r.token_ids for r in engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))]


def _configs(make):
    yield "budget64", make(max_num_batched_tokens=64)
    yield "budget7", make(max_num_batched_tokens=7)
    yield "no_prefix_cache", make(enable_prefix_cache=False, max_num_batched_tokens=32)


def test_greedy_identical_across_batching_tiny(tiny_engine_factory):
    base = tiny_engine_factory()
    one_at_a_time = [_run(base, [p])[0] for p in PROMPTS]
    assert _run(base, PROMPTS) == one_at_a_time
    for name, eng in _configs(tiny_engine_factory):
        assert _run(eng, PROMPTS) == one_at_a_time, name
    # A pool of 10 pages (160 tokens) for 9 prompts of up to ~50 tokens: preemption must happen.
    small = tiny_engine_factory(kv_cache_tokens=160, max_num_batched_tokens=64)
    assert _run(small, PROMPTS) == one_at_a_time
    assert small.core.scheduler.num_preemptions > 0


def test_constrained_outputs_survive_preemption(tiny_engine_factory):
    """Preempted constrained requests are recomputed from their tokens; the grammar state
    (including fast-forwarded tokens) carries over, so the outputs are the same as alone."""
    schema = {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["ab", "cd", "ef"]}, "maxItems": 6},
            "ok": {"type": "boolean"},
        },
        "required": ["tags", "ok"],
        "additionalProperties": False,
    }
    params = SamplingParams(max_tokens=40)

    def run(eng, prompts):
        eng.core.check_each_step = True
        return [(r.token_ids, r.usage.forced_tokens) for r in eng.generate(prompts, params, schema=schema)]

    base = tiny_engine_factory()
    alone = [run(base, [p])[0] for p in PROMPTS]
    small = tiny_engine_factory(kv_cache_tokens=160, max_num_batched_tokens=64)
    assert run(small, PROMPTS) == alone
    assert small.core.scheduler.num_preemptions > 0 and sum(f for _, f in alone) > 0


@pytest.mark.slow
def test_greedy_identical_across_batching_default_model(default_model_dir):
    eng = Engine(max_num_seqs=16)
    one_at_a_time = [_run(eng, [p], 8)[0] for p in PROMPTS]
    assert _run(eng, PROMPTS, 8) == one_at_a_time
    eng7 = Engine(max_num_batched_tokens=7, kv_cache_tokens=4096)
    assert _run(eng7, PROMPTS, 8) == one_at_a_time
    small = Engine(kv_cache_tokens=192, max_num_batched_tokens=64, enable_prefix_cache=False)
    assert _run(small, PROMPTS, 8) == one_at_a_time
    assert small.core.scheduler.num_preemptions > 0


def test_decodes_are_never_stalled_by_a_long_prefill(tiny_engine_factory):
    eng = tiny_engine_factory(max_num_batched_tokens=16, pipeline=False)  # runs the steps by hand
    sched = eng.core.scheduler
    from constrained_serve.engine.request import Request

    short = Request(eng.encode_prompt("Hi"), SamplingParams(max_tokens=30, ignore_eos=True))
    eng.core.add(short)
    eng.core.step()  # short is now decoding
    long = Request(eng.encode_prompt("word " * 200), SamplingParams(max_tokens=2, ignore_eos=True))
    eng.core.add(long)
    for _ in range(5):
        before = short.num_output
        batch = sched.schedule()
        assert any(c.request is short and c.num_new == 1 for c in batch.chunks)
        assert batch.num_tokens <= 16
        # Give the batch back: undo page reservation effects are not needed, run it for real.
        inputs = eng.core.runner.prepare(batch)
        logits = eng.core.runner.forward(inputs)
        reqs = [c.request for c in batch.sampling_chunks]
        eng.core.updater.account(batch)
        eng.core.updater.take_tokens([(r, t, None) for r, t in zip(reqs, eng.core.sampler(logits, reqs, None))])
        assert short.num_output == before + 1


def test_prompt_longer_than_context_is_refused_at_submit(tiny_engine_factory):
    from constrained_serve import PromptTooLongError

    eng = tiny_engine_factory(kv_cache_tokens=64)
    with pytest.raises(PromptTooLongError, match="tokens"):
        eng.generate("word " * 100, SamplingParams(max_tokens=4))
    # In a list, the long one fails alone and the others run.
    rs = eng.generate(["hi", "word " * 100], SamplingParams(max_tokens=4))
    assert rs[0].error is None and rs[0].finish_reason in ("stop", "length")
    assert rs[1].error_type == "PromptTooLongError" and rs[1].finish_reason == "abort"


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
    off = tiny_engine_factory(kv_cache_tokens=512, max_num_batched_tokens=48, max_num_seqs=6, enable_prefix_cache=False)
    on.core.check_each_step = True
    off.core.check_each_step = True
    prompts, lens = _random_workload(seed, on.tokenizer)
    # Two waves: the second reuses what the first left in the cache.
    for wave in range(2):
        for eng in (on, off):
            eng._out = [
                r.token_ids for r in eng.generate(prompts, SamplingParams(max_tokens=max(lens) + wave, ignore_eos=True))
            ]
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
    ra = eng.inputs.new_request(first, SamplingParams(max_tokens=60, ignore_eos=True), None, 0, None)
    eng.core.add(ra)
    for _ in range(7):  # prefill, then 6 decoded tokens
        eng.core.step()
    rb = eng.inputs.new_request(second, SamplingParams(max_tokens=3, ignore_eos=True), None, 1, None)
    eng.core.add(rb)
    steps = 0
    while not rb.finished:
        eng.core.step()
        steps += 1
    assert steps <= 4 and not ra.finished
    assert rb.output_ids == alone.token_ids and rb.num_cached >= 12


def test_the_garbage_collector_pauses_during_a_step_only(tiny_engine_factory):
    """Steps run with the cyclic GC off (engine.py _gc_paused); the caller's setting is
    restored after each, whether it had the collector on or off."""
    import gc

    eng = tiny_engine_factory()
    seen = []
    forward = eng.core.runner.forward

    def spy(inputs):
        seen.append(gc.isenabled())
        return forward(inputs)

    eng.core.runner.forward = spy
    assert gc.isenabled()
    eng.generate("hello", SamplingParams(max_tokens=3, ignore_eos=True))
    assert seen and not any(seen) and gc.isenabled()
    gc.disable()
    try:
        eng.generate("hello", SamplingParams(max_tokens=3, ignore_eos=True))
        assert not gc.isenabled()
    finally:
        gc.enable()
