"""Sampling parameters: validation, seeds, stop strings, stop tokens, max_tokens."""

import pytest

from constrained_serve import SamplingParams
from constrained_serve.kernels.sampling import sample_torch
from constrained_serve.sampler import step_seed


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(max_tokens=-1), "max_tokens"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.01), "min_p"),
        (dict(stop=[""]), "stop"),
        # non-finite numbers, wrong types: refused up front, never a NaN sampler or a mid-batch crash
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature="0.5"), "temperature"),
        (dict(temperature=None), "temperature"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(stop=["a", 3]), "stop"),
        (dict(stop=123), "stop"),
        (dict(stop_token_ids=["a"]), "stop_token_ids"),
        (dict(stop_token_ids=[1.7]), "stop_token_ids"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(top_k=True), "top_k"),
        (dict(max_tokens=True), "max_tokens"),
        (dict(seed=True), "seed"),
        (dict(ignore_eos="no"), "ignore_eos"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        # values the float32/int32 sampler would turn into inf or 0
        (dict(temperature=1e39), "temperature"),
        (dict(top_p=1e-46), "top_p"),
        (dict(repetition_penalty=1e-46), "repetition_penalty"),
        (dict(top_k=2**31), "top_k"),
        (dict(seed=2**70), "seed"),
        (dict(temperature=10**400), "temperature"),
        (dict(n=0), "n"),
        (dict(n=1.0), "n"),
        (dict(n=257), "n"),
    ],
)
def test_bad_sampling_params_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_vllm_spellings_of_off_and_the_edges():
    """top_k=-1 means off (vLLM); min_p=1 keeps only the most likely token (and its ties)."""
    assert SamplingParams(top_k=-1).top_k == 0
    import torch

    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]]).repeat(200, 1)
    col = lambda v, dt: torch.full((200,), v, dtype=dt)  # noqa: E731
    tokens = sample_torch(
        logits,
        None,
        col(1.0, torch.float32),
        col(0, torch.int64),
        col(1.0, torch.float32),
        col(SamplingParams(min_p=1.0).min_p, torch.float32),
        torch.arange(200),
    )
    assert set(tokens.tolist()) == {1, 2}


def test_params_take_numpy_numbers_and_any_iterable(tiny_engine_factory):
    import numpy as np

    p = SamplingParams(
        max_tokens=np.int64(3),
        temperature=np.float32(1.0),
        seed=np.int64(3),
        stop={"zz"},
        stop_token_ids=np.array([2, 3]),
        ignore_eos=True,
    )
    assert type(p.seed) is int and type(p.max_tokens) is int and type(p.temperature) is float
    assert p.stop == ("zz",) and p.stop_token_ids == (2, 3)
    [r] = tiny_engine_factory().generate(["a"], p)  # a numpy seed overflowed the per-step seed mix
    assert r.error is None and len(r.token_ids) <= 3


def test_params_are_checked_again_at_submit(tiny_engine_factory):
    eng = tiny_engine_factory()
    p = SamplingParams(max_tokens=3, stop=None, stop_token_ids=None)
    assert p.stop == () and p.stop_token_ids == ()
    p.max_tokens = 0  # changed after construction
    with pytest.raises(ValueError, match="max_tokens"):
        eng.generate(["a", "b"], p)
    with pytest.raises(ValueError, match="temperature"):
        q = SamplingParams(max_tokens=3)
        q.temperature = float("nan")
        list(eng.stream("a", q))
    assert not eng.core.has_work()


def test_bad_engine_args_name_the_argument(tiny_llama_dir, monkeypatch):
    from constrained_serve import Engine
    from constrained_serve.config import EngineConfig

    with pytest.raises(ValueError, match="max_model_len"):
        Engine(model=str(tiny_llama_dir), max_model_len=0)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert EngineConfig().cpu_threads() == 1 and EngineConfig(num_threads=3).cpu_threads() == 3
    with pytest.raises(ValueError, match="device"):
        Engine(model=str(tiny_llama_dir), device="tpu")
    with pytest.raises(ValueError, match="model"):
        Engine(model="/nonexistent/model/dir")


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


def test_stop_strings_cut_the_text(tiny_engine_factory):
    eng = tiny_engine_factory()
    free = eng.generate("Once upon", SamplingParams(max_tokens=24, ignore_eos=True))[0]
    assert len(free.text) > 6
    stop = free.text[4:7]
    r = eng.generate("Once upon", SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop]))[0]
    assert r.finish_reason == "stop" and r.stop_reason == stop
    assert stop not in r.text
    assert free.text.startswith(r.text)
    # A stream shows exactly the result's text: never the stop string, nor what follows it.
    assert "".join(eng.stream("Once upon", SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop]))) == r.text


def test_cut_at_stop_holds_back_a_possible_stop_start():
    from constrained_serve.detokenizer import cut_at_stop

    assert cut_at_stop("Hello. World", ["."], final=False) == "Hello"
    assert cut_at_stop("abc s ar", ["s are"], final=False) == "abc "  # "s ar" may become "s are"
    assert cut_at_stop("abc s ar", ["s are"], final=True) == "abc s ar"
    assert cut_at_stop("x END y END", ["END", "y"], final=True) == "x "  # the earliest stop wins
    assert cut_at_stop("plain", [], final=False) == "plain"


def test_stop_token_ids_and_max_tokens(tiny_engine_factory):
    eng = tiny_engine_factory()
    free = eng.generate("Once upon", SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 10
    tok = free.token_ids[3]
    r = eng.generate("Once upon", SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[tok]))[0]
    assert r.finish_reason == "stop" and r.token_ids[-1] == tok and tok not in r.token_ids[:-1]
    assert r.stop_reason == tok and free.stop_reason is None
    # As in vLLM, the stop token stays in token_ids but its text is not part of the output.
    before = eng.tokenizer.decode(r.token_ids[:-1])
    assert r.text == before and free.text.startswith(before + eng.tokenizer.decode([tok]))
    assert (
        "".join(eng.stream("Once upon", SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[tok]))) == r.text
    )


def test_sampler_filters():
    import torch

    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    z = torch.zeros(4)
    greedy = sample_torch(
        logits.clone(), None, z, torch.zeros(4, dtype=torch.int32), z + 1, z, torch.arange(4), all_greedy=False
    )
    assert torch.equal(greedy, logits.argmax(-1))
    # top_k=1 at any temperature is greedy; min_p close to 1 keeps only the argmax.
    t = torch.ones(4)
    k1 = sample_torch(logits.clone(), None, t, torch.ones(4, dtype=torch.int32), t, z, torch.arange(4))
    assert torch.equal(k1, logits.argmax(-1))
    mp = sample_torch(logits.clone(), None, t, torch.zeros(4, dtype=torch.int32), t, z + 0.999, torch.arange(4))
    assert torch.equal(mp, logits.argmax(-1))
    # top_p: tokens outside the nucleus are never drawn.
    probs = torch.softmax(logits[0], -1)
    order = probs.argsort(descending=True)
    nucleus = set(order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist())
    for s in range(200):
        tok = sample_torch(
            logits[:1].clone(),
            None,
            t[:1],
            torch.zeros(1, dtype=torch.int32),
            torch.tensor([0.5]),
            z[:1],
            torch.tensor([step_seed(s, 0)]),
        )
        assert int(tok) in nucleus


def test_step_seed_mixes():
    seeds = {step_seed(s, p) for s in range(20) for p in range(20)}
    assert len(seeds) == 400


def test_stop_string_inside_a_long_fast_forward_is_seen(tiny_engine_factory):
    """The grammar forces ~100 characters in one go; the stop string sits near their start.
    It must end the request there (the old check only looked at the last 64 characters)."""
    eng = tiny_engine_factory()
    forced = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma: "
    [r] = eng.generate(["x"], SamplingParams(max_tokens=60, stop=["beta"]), regex=forced + "[a-z ]{0,80}")
    [whole] = eng.generate(["x"], SamplingParams(max_tokens=60), regex=forced + "[a-z ]{0,80}")
    assert whole.usage.forced_tokens > 10
    assert r.finish_reason == "stop" and r.text == "alpha " and r.stop_reason == "beta"
    assert r.parsed is None and r.error_type == "truncated" and "stop string 'beta'" in r.error
    assert r.usage.completion_tokens == r.usage.forced_tokens  # nothing sampled after the stop
    # The output ends at the token that completes the stop string, as had the forced tokens
    # been sampled one by one (fast_forward=False): none of the forced tokens after it.
    ids = eng.tokenizer.encode(forced, add_special_tokens=False)
    n = next(i + 1 for i in range(len(ids)) if "beta" in eng.tokenizer.decode(ids[: i + 1]))
    assert r.token_ids == ids[:n]


@pytest.mark.parametrize("fast_forward", [True, False])
def test_stop_token_among_forced_tokens_ends_there(tiny_engine_factory, fast_forward):
    """A stop token ends the output where it stands, whether the grammar forced it (fast-forward)
    or it was sampled under a one-token mask; a constrained output cut short says so."""
    eng = tiny_engine_factory(fast_forward=fast_forward)
    text = "alpha beta gamma delta"
    ids = eng.tokenizer.encode(text, add_special_tokens=False)
    stop = ids[len(ids) // 2]
    [r] = eng.generate(["x"], SamplingParams(max_tokens=30, stop_token_ids=[stop]), regex=text + "!")
    assert r.token_ids == ids[: len(ids) // 2 + 1]
    assert r.text == eng.tokenizer.decode(ids[: len(ids) // 2])  # without the stop token's text
    assert r.finish_reason == "stop" and r.stop_reason == stop
    assert (r.usage.forced_tokens > 0) == fast_forward
    assert r.parsed is None and r.error_type == "truncated" and "stop token" in r.error


def test_stop_string_leaving_a_complete_match_is_not_an_error(tiny_engine_factory):
    """A stop string may cut a constrained output where the grammar could have ended: that
    output is complete (parsed, no error); where it could not, the result says it was cut."""
    eng = tiny_engine_factory()
    seen = set()
    for seed in range(40):
        p = SamplingParams(max_tokens=8, temperature=1.0, seed=seed)
        [free] = eng.generate(["x"], p, regex="[ab]{1,8}")
        cut = free.text.find("b")
        if cut < 0 or (cut > 0) in seen:
            continue
        seen.add(cut > 0)
        p = SamplingParams(max_tokens=8, temperature=1.0, seed=seed, stop=["b"])
        [r] = eng.generate(["x"], p, regex="[ab]{1,8}")
        assert r.text == free.text[:cut] and r.stop_reason == "b"
        if cut > 0:
            assert r.ok and r.parsed == r.text and r.error is None
        else:  # an empty output does not match [ab]{1,8}
            assert r.parsed is None and r.error_type == "truncated"
        if seen == {False, True}:
            break
    assert seen == {False, True}, "the seeds never gave both a leading 'b' and a later one"


def test_stop_string_in_the_closing_text_cuts_it(tiny_engine_factory):
    """The grammar's last characters hold the stop string: the stop string wins (it cuts the
    text), and the result says the output is incomplete rather than failing to parse."""
    eng = tiny_engine_factory()
    [r] = eng.generate(["x"], SamplingParams(max_tokens=10, stop=["!"]), regex="abc!")
    assert r.text == "abc" and r.finish_reason == "stop" and r.stop_reason == "!"
    assert r.parsed is None and r.error_type == "truncated"


def test_penalty_params_are_validated():
    for bad in ({"repetition_penalty": 0}, {"presence_penalty": 2.5}, {"frequency_penalty": -3}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    assert not SamplingParams().penalized and SamplingParams(presence_penalty=0.5).penalized


def test_apply_penalties_matches_a_per_token_reference():
    import torch

    from constrained_serve.request import Request
    from constrained_serve.sampler import apply_penalties

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


def test_logprobs_param_is_validated():
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="logprobs"):
            SamplingParams(logprobs=bad)
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


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
