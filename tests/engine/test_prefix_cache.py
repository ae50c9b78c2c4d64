"""Radix prefix cache in the engine: random workloads, shared prefixes, partial pages."""

import random

import pytest

from constrained_serve import SamplingParams


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
