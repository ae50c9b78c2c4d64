"""The engine's step loop: continuous batching, chunked prefill and preemption never change
greedy outputs; decodes are never stalled by a long prefill; prompts too long are refused."""

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
    eng = tiny_engine_factory(max_num_batched_tokens=16)
    sched = eng.core.scheduler
    from constrained_serve.request import Request

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
        eng.core._update(batch, eng.core.sampler(logits, [c.request for c in batch.sampling_chunks], None))
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
