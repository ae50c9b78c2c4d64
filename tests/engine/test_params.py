"""SamplingParams (params.py): every bad value refused up front with the argument's name,
vLLM's spellings of off, numpy numbers and any iterable, and the check again at submit."""

import pytest

from constrained_serve import SamplingParams
from constrained_serve.kernels.sampling import sample_torch
from constrained_serve.kernels.sampling_tensors import SamplingTensors


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
    params = SamplingTensors.full(200, temperature=1.0, min_p=SamplingParams(min_p=1.0).min_p)
    tokens = sample_torch(logits, None, params)
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


def test_penalty_params_are_validated():
    for bad in ({"repetition_penalty": 0}, {"presence_penalty": 2.5}, {"frequency_penalty": -3}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    assert not SamplingParams().penalized and SamplingParams(presence_penalty=0.5).penalized


def test_logprobs_param_is_validated():
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="logprobs"):
            SamplingParams(logprobs=bad)
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
