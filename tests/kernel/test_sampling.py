"""Masked sampling: the torch reference and the fused Triton kernel (under TRITON_INTERPRET=1
on CPU), checked against the definition: masks are never violated, greedy is the masked
argmax, seeded draws are reproducible and follow the filtered softmax (chi-square); the torch
path's top-k, min-p and top-p filters; greedy_masked, which masks only the rows whose argmax
the grammar refuses, picks what masking every row picks."""

from __future__ import annotations

import math

import pytest
import torch

from constrained_serve.kernels import sampling as S
from constrained_serve.kernels.sampling import apply_bitmask_torch, greedy_masked, sample_torch
from constrained_serve.kernels.sampling_tensors import SamplingTensors
from constrained_serve.runtime.sampler import step_seed

from .helpers import CHI2_CRIT_001, expected_probs, require_triton


def _impl(name: str):
    if name == "triton":
        require_triton()
        return S.sample_triton
    return S.sample_torch


def _params(R: int, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed0=0) -> SamplingTensors:
    return SamplingTensors.full(R, "cpu", temperature, top_k, top_p, min_p, seed0)


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """bool [R, V] -> packed int32 [R, ceil(V/32)] (bit t%32 of word t//32)."""
    R, V = allowed.shape
    W = -(-V // 32)
    padded = torch.zeros(R, W * 32, dtype=torch.int64)
    padded[:, :V] = allowed.long()
    words = (padded.view(R, W, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


# (name, logits, allowed-token mask or None, T, top_k, top_p, min_p). Logits cross zero and
# one case is all negative and large: the Triton radix select orders floats by their bits.
_V = 12
_BASE = torch.linspace(-1.5, 1.5, _V)[torch.randperm(_V, generator=torch.Generator().manual_seed(0))]
_MASK = torch.ones(_V, dtype=torch.bool)
_MASK[[1, 4, 9]] = False
CHI2_CASES = [
    ("plain", _BASE, None, 1.0, 0, 1.0, 0.0),
    ("temp_topk", _BASE, None, 0.7, 5, 1.0, 0.0),
    ("topp_masked", _BASE, _MASK, 1.0, 0, 0.8, 0.0),
    ("minp_negative", _BASE - 60.0, None, 1.3, 0, 1.0, 0.15),
    ("all_filters", _BASE * 2, _MASK, 1.5, 6, 0.9, 0.05),
]


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("case", CHI2_CASES, ids=[c[0] for c in CHI2_CASES])
def test_seeded_draws_follow_filtered_softmax(impl, case):
    sample = _impl(impl)
    _, base, allowed, T, k, p, mp = case
    N = 3000
    logits = base.repeat(N, 1)
    bitmask = None if allowed is None else _pack(allowed.repeat(N, 1))
    tokens = sample(logits, bitmask, _params(N, T, k, p, mp, seed0=1000))
    counts = torch.bincount(tokens, minlength=_V).double()
    expected = expected_probs(base, allowed, T, k, p, mp) * N
    outside = expected == 0
    assert counts[outside].sum() == 0, f"drew filtered-out tokens: {counts.tolist()}"
    kept = ~outside
    assert expected[kept].min() >= 5, "case too skewed for a chi-square test"
    stat = float(((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum())
    df = int(kept.sum()) - 1
    assert stat < CHI2_CRIT_001[df], (stat, df, counts.tolist(), expected.tolist())


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_masked_tokens_never_chosen(impl):
    sample = _impl(impl)
    g = torch.Generator().manual_seed(1)
    R, V = 2000, 70  # 70: the last bitmask word is partial
    allowed = torch.rand(R, V, generator=g) < 0.3
    allowed[torch.arange(R), torch.randint(0, V, (R,), generator=g)] = True
    # Adversarial: forbidden tokens carry the largest logits.
    logits = torch.randn(R, V, generator=g) + 8.0 * (~allowed).float()
    temperature = torch.rand(R, generator=g) * 2.0
    temperature[::7] = 0.0
    top_k = torch.randint(0, 10, (R,), generator=g)
    top_p = torch.where(torch.rand(R, generator=g) < 0.5, 0.9, 1.0)
    min_p = torch.where(torch.rand(R, generator=g) < 0.3, 0.1, 0.0)
    params = _params(R, temperature, top_k, top_p, min_p)
    tokens = sample(logits, _pack(allowed), params)
    assert tokens.dtype == torch.int64 and tokens.shape == (R,)
    assert bool(allowed[torch.arange(R), tokens].all())


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_greedy_is_masked_argmax(impl, dtype):
    sample = _impl(impl)
    g = torch.Generator().manual_seed(2)
    R, V = 40, 300
    logits = torch.randn(R, V, generator=g).to(dtype)
    allowed = torch.rand(R, V, generator=g) < 0.5
    allowed[0] = True  # an unconstrained row
    allowed[1, :] = False
    allowed[1, V - 1] = True  # a single allowed token, in the last partial word
    want = logits.float().masked_fill(~allowed, -math.inf).argmax(-1)
    bitmask = _pack(allowed)
    got = sample(logits, bitmask, _params(R, 0.0), all_greedy=True)
    assert torch.equal(got, want)
    # temperature == 0 rows among sampled rows
    temperature = torch.where(torch.arange(R) % 2 == 0, 0.0, 1.0)
    got = sample(logits, bitmask, _params(R, temperature, top_k=3))
    assert torch.equal(got[::2], want[::2])


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_same_seed_same_token_whatever_the_batch(impl):
    sample = _impl(impl)
    g = torch.Generator().manual_seed(3)
    R, V = 64, 50
    logits = torch.randn(R, V, generator=g)
    params = _params(R, 1.0, top_k=20, top_p=0.95)
    a = sample(logits, None, params)
    b = sample(logits, None, params)
    assert torch.equal(a, b)
    sub = SamplingTensors(*(v[10:20] for v in params))
    assert torch.equal(sample(logits[10:20].contiguous(), None, sub), a[10:20])
    other = params._replace(seeds=params.seeds + 12345)
    assert not torch.equal(sample(logits, None, other), a)


def test_reference_does_not_modify_logits():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 40, generator=g)
    before = logits.clone()
    allowed = torch.rand(4, 40, generator=g) < 0.5
    allowed[:, 0] = True
    S.sample_torch(logits, _pack(allowed), _params(4, 1.0))
    assert torch.equal(logits, before)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_ties_at_the_threshold_are_kept(impl):
    """top-k and top-p keep every token tied at the threshold (HF's warpers and vLLM drop
    only tokens below it); the torch path used to keep an arbitrary subset by sort rank."""
    sample = _impl(impl)
    N = 600
    for base, kw, kept in (
        (torch.tensor([3.0, 1.0, 1.0, 1.0, -2.0, 0.5]), {"top_k": 2}, {0, 1, 2, 3}),
        (torch.tensor([1.0, 1.0, 1.0, -9.0, -9.0]), {"top_k": 1}, {0, 1, 2}),
        (torch.tensor([2.0, 0.0, 0.0, 0.0, -9.0]), {"top_p": 0.75}, {0, 1, 2, 3}),
    ):
        tokens = sample(base.repeat(N, 1), None, _params(N, 1.0, **kw))
        assert set(torch.unique(tokens).tolist()) == kept, (base, kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("V", [64, 100])
def test_bitmask_triton_matches_reference(dtype, V):
    require_triton()
    g = torch.Generator().manual_seed(5)
    R = 6
    logits = torch.randn(R, V, generator=g).to(dtype)
    allowed = torch.rand(R, V, generator=g) < 0.4
    allowed[0] = True
    allowed[1] = False
    bitmask = _pack(allowed)
    assert int(bitmask[0, 0]) == -1
    ref = S.apply_bitmask_torch(logits.clone(), bitmask)
    out = S.apply_bitmask_triton(logits.clone(), bitmask, block_v=32)
    assert torch.equal(ref, out)
    assert torch.equal(out[0], logits[0])
    assert bool(torch.isinf(out[~allowed]).all()) and torch.equal(out[allowed], logits[allowed])


def test_pack_helper_matches_unpack():
    g = torch.Generator().manual_seed(6)
    allowed = torch.rand(3, 77, generator=g) < 0.5
    assert torch.equal(S.unpack_bitmask(_pack(allowed), 77), allowed)


def test_sampler_filters():
    import torch

    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    greedy = sample_torch(logits.clone(), None, SamplingTensors.full(4))
    assert torch.equal(greedy, logits.argmax(-1))
    # top_k=1 at any temperature is greedy; min_p close to 1 keeps only the argmax.
    k1 = sample_torch(logits.clone(), None, SamplingTensors.full(4, temperature=1.0, top_k=1))
    assert torch.equal(k1, logits.argmax(-1))
    mp = sample_torch(logits.clone(), None, SamplingTensors.full(4, temperature=1.0, min_p=0.999))
    assert torch.equal(mp, logits.argmax(-1))
    # top_p: tokens outside the nucleus are never drawn.
    probs = torch.softmax(logits[0], -1)
    order = probs.argsort(descending=True)
    nucleus = set(order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist())
    for s in range(200):
        params = SamplingTensors.full(1, temperature=1.0, top_p=0.5, seed0=step_seed(s, 0))
        tok = sample_torch(logits[:1].clone(), None, params)
        assert int(tok) in nucleus


def reference(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    return apply_bitmask_torch(logits.float().clone(), bitmask).argmax(dim=-1)


def test_equals_masking_every_row_with_ties_and_empty_masks():
    g = torch.Generator().manual_seed(0)
    rows, vocab = 64, 1000  # not a multiple of 32: the last word is partial
    words = -(-vocab // 32)
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(rows, vocab, generator=g).to(dtype)
        logits[5, [3, 700]] = 50.0  # a tie at the top; the first is allowed below, then refused
        logits[6, [3, 700]] = 50.0
        bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=g, dtype=torch.int32)
        bitmask[:20] = -1  # rows that allow everything: their argmax stands
        bitmask[6, 0] &= ~(1 << 3)  # row 6 refuses token 3: 700 wins the tie
        bitmask[7] = 0  # allows nothing: token 0, as the full mask gives
        got = greedy_masked(logits, bitmask)
        torch.testing.assert_close(got, reference(logits, bitmask))
        assert got[6] == 700
        assert greedy_masked(logits, None).tolist() == logits.argmax(dim=-1).tolist()


def test_the_callers_logits_are_left_alone():
    logits = torch.randn(4, 64)
    before = logits.clone()
    greedy_masked(logits, torch.zeros(4, 2, dtype=torch.int32))
    assert torch.equal(logits, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_argmax_is_argmax_with_ties_inf_and_nan(dtype):
    """row_argmax (max(dim).indices, faster on CPU) picks what argmax picks: the first
    maximum, on rows full of ties, all -inf, or holding NaN."""
    g = torch.Generator().manual_seed(4)
    x = torch.randint(-3, 3, (32, 301), generator=g).to(dtype)
    x[1] = -math.inf
    x[2, 7] = math.nan
    x[3, [4, 200]] = math.nan
    assert torch.equal(S.row_argmax(x), x.argmax(-1))
