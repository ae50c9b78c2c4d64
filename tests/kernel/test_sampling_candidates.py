"""The top-k candidate path of GPU sampling (sampling_candidates.py), under TRITON_INTERPRET=1:
for rows with a small top_k it keeps the same tokens as the fused kernel's threshold search
(top-k, top-p, min-p, ties, masks) and draws with the same noise, so it gives the fused
kernel's tokens exactly; rows whose ties overflow the candidates are redone by the fused
kernel; and the draws follow the filtered softmax."""

from __future__ import annotations

import pytest
import torch

from constrained_serve.kernels import sampling as S
from constrained_serve.kernels.sampling_candidates import CANDIDATES_MAX, candidate_rows, sample_candidates

from .helpers import CHI2_CRIT_001, expected_probs, require_triton
from .test_sampling import _pack, _params


@pytest.fixture(autouse=True)
def _triton():
    require_triton()


def _batch(R: int, V: int, seed: int, quantum: float | None = None):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(R, V, generator=g) * 2
    if quantum is not None:  # many equal values, as bf16 logits have
        logits = (logits / quantum).round() * quantum
    allowed = torch.rand(R, V, generator=g) < 0.7
    top_k = torch.randint(1, 40, (R,), generator=g)
    top_p = torch.where(torch.rand(R, generator=g) < 0.5, torch.rand(R, generator=g) * 0.9 + 0.05, torch.ones(R))
    min_p = torch.where(torch.rand(R, generator=g) < 0.3, torch.rand(R, generator=g) * 0.2, torch.zeros(R))
    temperature = torch.rand(R, generator=g) * 1.5 + 0.2
    params = _params(R, temperature, top_k, top_p, min_p, seed0=seed * 1000)
    return logits, _pack(allowed), params


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_candidate_tokens_equal_the_fused_kernels(seed):
    logits, bitmask, params = _batch(48, 300, seed)
    fused = S.sample_triton(logits, bitmask, params)
    k_max = int(params.top_k.max())
    tokens, overflow = sample_candidates(logits, bitmask, params, k_max)
    assert not overflow.any()
    assert torch.equal(tokens, fused), (tokens != fused).nonzero().flatten().tolist()


def test_ties_past_the_candidates_fall_back_to_the_fused_kernel():
    # Logits on a coarse grid: the k-th value is tied well past k_max + 1 candidates.
    logits, bitmask, params = _batch(32, 300, 7, quantum=1.0)
    params = params._replace(top_k=torch.full((32,), 3, dtype=torch.int32))
    fused = S.sample_triton(logits, bitmask, params)
    _, overflow = sample_candidates(logits, bitmask, params, 3)
    assert overflow.any(), "the case has no overflowing ties"
    rows = list(range(32))
    mixed = S.sample_triton(logits, bitmask, params, candidates=(rows, 3))
    assert torch.equal(mixed, fused)


def test_a_mixed_batch_gives_each_row_its_own_draw():
    """Candidate rows next to greedy, unfiltered and top-p-only rows: every row draws what it
    draws alone, and what the fused kernel draws for it."""
    logits, bitmask, params = _batch(24, 200, 3)
    params.top_k[::3] = 0  # top-p only, or no filter
    params.temperature[1::6] = 0.0  # greedy
    temps, ks = params.temperature.tolist(), params.top_k.tolist()
    rows = candidate_rows(temps, ks, 200)
    assert rows and len(rows) < 24
    fused = S.sample_triton(logits, bitmask, params)
    mixed = S.sample_triton(logits, bitmask, params, candidates=(rows, max(ks[i] for i in rows)))
    assert torch.equal(mixed, fused)
    alone = S.sample_triton(
        logits[rows[:1]],
        bitmask[rows[:1]],
        params.index_select(torch.tensor(rows[:1])),
        candidates=([0], ks[rows[0]]),
    )
    assert alone.item() == fused[rows[0]].item()


def test_candidate_rows_are_sampling_rows_with_a_small_top_k():
    assert candidate_rows([1.0, 0.0, 0.7, 1.0, 1.0, 1.0], [5, 5, 0, CANDIDATES_MAX + 1, 100, 99], 100) == [0, 5]
    assert candidate_rows([1.0], [50], 51) == [0]


@pytest.mark.parametrize("T, k, p, mp", [(0.7, 5, 1.0, 0.0), (1.5, 6, 0.9, 0.05)])
def test_candidate_draws_follow_the_filtered_softmax(T, k, p, mp):
    from .test_sampling import _BASE, _MASK, _V

    # 400 draws: the smallest expected count is still 22 (p 0.055; the chi-square test wants
    # at least 5), and the interpreter, which runs the rows one by one, runs 400 (3000 took 112 s).
    N = 400
    logits = _BASE.repeat(N, 1)
    bitmask = _pack(_MASK.repeat(N, 1))
    tokens, overflow = sample_candidates(logits, bitmask, _params(N, T, k, p, mp, seed0=77), k)
    assert not overflow.any()
    counts = torch.bincount(tokens, minlength=_V).double()
    expected = expected_probs(_BASE, _MASK, T, k, p, mp) * N
    kept = expected > 0
    assert counts[~kept].sum() == 0
    stat = float(((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum())
    assert stat < CHI2_CRIT_001[int(kept.sum()) - 1], (stat, counts.tolist(), expected.tolist())
