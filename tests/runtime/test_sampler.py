"""Sampling (sampler.py): seeds mixed with the position, so a seeded request draws the same
tokens whatever shares its batch; n samples of one prompt; repetition, presence and frequency
penalties; the raw logprobs of sampled and prompt tokens."""

import pytest

from constrained_serve import SamplingParams
from constrained_serve.runtime.sampler import step_seed


def test_seeded_sampling_is_batch_independent(tiny_engine_factory):
    eng = tiny_engine_factory()
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = eng.generate("Tell me a story", p)[0].token_ids
    others = ["x " * n for n in range(1, 6)]
    mixed = eng.generate(others[:2] + ["Tell me a story"] + others[2:], p)
    assert mixed[2].token_ids == alone
    again = eng.generate(["Tell me a story"] * 3, p)
    assert all(r.token_ids == alone for r in again)
    other_seed = eng.generate("Tell me a story", SamplingParams(**{**p.__dict__, "seed": 99}))[0].token_ids
    assert other_seed != alone


def test_n_samples_share_the_prompt_and_differ(tiny_engine_factory):
    """SamplingParams(n=4): four independent completions of each prompt, in
    Result.samples; the first is what n=1 gives with the same seed; the prompt is computed
    once (the samples wait for its pages in the prefix cache) and counted once in usage."""
    eng = tiny_engine_factory()
    prompt = "Tell me a story about a cat and a dog. " * 6
    p = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True, n=4)
    one = eng.generate(prompt, SamplingParams(**{**p.__dict__, "n": 1}))[0]
    eng2 = tiny_engine_factory()
    before = eng2.core.runner.tokens_computed
    [res, other] = eng2.generate([prompt, "x"], p)
    computed = eng2.core.runner.tokens_computed - before
    assert len(res.samples) == 4 and len(other.samples) == 4
    assert res.samples[0].token_ids == one.token_ids == res.token_ids and res.text == one.text
    assert len({tuple(s.token_ids) for s in res.samples}) == 4
    assert all(s.index == 0 and s.samples is None for s in res.samples)
    assert res.usage.completion_tokens == 48 and res.usage.prompt_tokens == one.usage.prompt_tokens
    num_prompt = one.usage.prompt_tokens
    assert computed < num_prompt + 3 * 16 + 4 * 12 + 4 * 12, "the prompt was computed per sample"
    again = eng2.generate(prompt, p)[0]
    assert [s.token_ids for s in again.samples] == [s.token_ids for s in res.samples]


def test_n_samples_all_match_the_schema(tiny_engine_factory):
    eng = tiny_engine_factory()
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    [res] = eng.generate(["{"], SamplingParams(max_tokens=40, temperature=1.0, seed=3, n=3), schema=schema)
    done = [s for s in res.samples if s.finish_reason == "stop"]
    assert done, [s.text for s in res.samples]
    for s in done:
        assert set(s.json) == {"a", "b"} and s.json["b"] in ("x", "y")
    for s in res.samples:
        if s.finish_reason == "length":
            assert s.error_type == "truncated" and s.json is None


def test_n_takes_one_completion_where_only_one_makes_sense(tiny_engine_factory):
    eng = tiny_engine_factory()
    with pytest.raises(ValueError, match="n must be 1"):
        eng.stream("x", SamplingParams(n=2))
    with eng.conversation() as conv, pytest.raises(ValueError, match="n must be 1"):
        conv.send("hi", SamplingParams(n=2))


def test_unseeded_sampling_varies(tiny_engine_factory):
    eng = tiny_engine_factory()
    p = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    outs = {tuple(r.token_ids) for r in eng.generate(["Tell me a story"] * 4, p)}
    assert len(outs) > 1


def test_step_seed_mixes():
    seeds = {step_seed(s, p) for s in range(20) for p in range(20)}
    assert len(seeds) == 400


def test_apply_penalties_matches_a_per_token_reference():
    import torch

    from constrained_serve.engine.request import Request
    from constrained_serve.runtime.sampler import apply_penalties

    torch.manual_seed(0)
    vocab = 40
    params = [
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(),
        SamplingParams(presence_penalty=0.7, frequency_penalty=0.3),
        SamplingParams(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=1.0),
    ]
    reqs = []
    for k, p in enumerate(params):
        r = Request(prompt_ids=[1, 2, 3, 3, 5 + k], params=p)
        r.token_ids += [3, 7, 7, 7, 9, 2 * k + 10]
        reqs.append(r)
    logits = torch.randn(len(reqs), vocab)
    expected = logits.clone()
    for i, r in enumerate(reqs):
        p = r.params
        for t in set(r.token_ids):
            v = expected[i, t]
            expected[i, t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        for t in set(r.output_ids):
            expected[i, t] -= p.presence_penalty + p.frequency_penalty * r.output_ids.count(t)
    apply_penalties(logits, reqs)
    assert torch.allclose(logits, expected, atol=1e-6)


def test_presence_penalty_stops_repeats_and_keeps_the_grammar(tiny_engine_factory):
    eng = tiny_engine_factory()
    prompt = "Tell me a story"
    [free] = eng.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))
    assert len(set(free.token_ids)) < len(free.token_ids), "the tiny model was expected to repeat itself"
    [pen] = eng.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True, presence_penalty=2.0))
    assert len(set(pen.token_ids)) == len(pen.token_ids)
    [con] = eng.generate(
        [prompt], SamplingParams(max_tokens=24, frequency_penalty=2.0, repetition_penalty=1.5), regex="[ab]{6}"
    )
    assert con.ok and len(con.text) == 6 and set(con.text) <= {"a", "b"}


def test_logprobs_are_the_models_raw_log_softmax(tiny_engine_factory, tiny_llama_dir):
    """Each sampled token's logprob and the top-k match HF transformers' log_softmax at that
    position (the raw distribution: before penalties, the grammar mask and temperature)."""
    import torch
    from transformers import AutoModelForCausalLM

    eng = tiny_engine_factory()
    p = SamplingParams(max_tokens=6, temperature=0.9, seed=3, logprobs=3, presence_penalty=1.0)
    [r] = eng.generate(["The capital of France is"], p, regex="[a-z ]{6,12}")
    prompt = eng.encode_prompt("The capital of France is")
    assert len(r.logprobs) == len(r.token_ids) >= 2 and r.usage.forced_tokens == 0
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt + r.token_ids])).logits[0].float(), -1)
    for j, (tok, entry) in enumerate(zip(r.token_ids, r.logprobs)):
        row = ref[len(prompt) + j - 1]
        assert list(entry)[0] == tok and abs(entry[tok] - row[tok].item()) < 1e-4
        top = row.topk(3).indices.tolist()
        assert set(entry) == {tok, *top}
        assert all(abs(entry[t] - row[t].item()) < 1e-4 for t in top)
    [plain] = eng.generate(["The capital of France is"], SamplingParams(max_tokens=2))
    assert plain.logprobs is None


@pytest.mark.parametrize("fast_forward", [True, False])
def test_logprobs_of_forced_tokens(tiny_engine_factory, fast_forward):
    """Forced tokens are never scored under fast-forward (None); without it they are sampled
    under a one-token mask and get their raw logprob like any other."""
    eng = tiny_engine_factory(fast_forward=fast_forward)
    [r] = eng.generate(["x"], SamplingParams(max_tokens=12, logprobs=0), regex="alpha beta gamma [ab]{2}")
    assert r.ok and len(r.logprobs) == len(r.token_ids)
    forced = [e is None for e in r.logprobs]
    assert sum(forced) == (r.usage.forced_tokens if fast_forward else 0)
    assert all(len(e) == 1 and e[t] <= 0 for t, e in zip(r.token_ids, r.logprobs) if e is not None)


@pytest.mark.parametrize("chunk", [512, 16])
def test_prompt_logprobs_match_transformers(tiny_engine_factory, tiny_llama_dir, chunk):
    """prompt_logprobs=k: each prompt token's logprob given the tokens before it, and the k
    most likely there, as HF transformers' log_softmax gives them; also when the prompt is
    prefilled in chunks, already in the prefix cache (which it must not reuse), shares its
    batch with other requests, or is sampled n times (scored once)."""
    import torch
    from transformers import AutoModelForCausalLM

    eng = tiny_engine_factory(max_num_batched_tokens=chunk)
    text = "The capital of France is Paris, and the capital of Italy is Rome. " * 3
    prompt = eng.encode_prompt(text)
    eng.generate([text], SamplingParams(max_tokens=2))  # now cached
    p = SamplingParams(max_tokens=3, prompt_logprobs=2, n=2, temperature=1.0, seed=1)
    res, other = eng.generate([text, "Hello there"], [p, SamplingParams(max_tokens=3)])
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    lps = res.prompt_logprobs
    assert len(lps) == len(prompt) and lps[0] is None and res.usage.cached_tokens == 0
    for i in range(1, len(prompt)):
        row, tok = ref[i - 1], prompt[i]
        assert list(lps[i])[0] == tok and abs(lps[i][tok] - row[tok].item()) < 1e-4
        top = row.topk(2).indices.tolist()
        assert set(lps[i]) == {tok, *top} and all(abs(lps[i][t] - row[t].item()) < 1e-4 for t in top)
    assert res.samples[1].prompt_logprobs is None and other.prompt_logprobs is None
    assert res.samples[1].usage.cached_tokens > 0  # the other sample reused the prompt's pages


def test_prompt_logprobs_survive_preemption(tiny_engine_factory):
    """A preempted request recomputes its prompt; its prompt logprobs are neither lost nor
    recorded twice."""
    eng = tiny_engine_factory(kv_cache_tokens=256, page_size=16, max_num_batched_tokens=64)
    text = "one two three four five six seven eight nine ten " * 4
    ref = eng.generate([text], SamplingParams(max_tokens=2, prompt_logprobs=0))[0].prompt_logprobs
    params = [SamplingParams(max_tokens=80, ignore_eos=True, prompt_logprobs=0)] * 8
    rs = eng.generate([text + str(i) for i in range(8)], params)
    assert eng.core.scheduler.num_preemptions > 0
    for r in rs:
        assert len(r.prompt_logprobs) == len(ref) + 1
        assert all(a == b or abs(a[k] - b[k]) < 1e-4 for a, b in zip(r.prompt_logprobs[1:], ref[1:]) for k in a)
