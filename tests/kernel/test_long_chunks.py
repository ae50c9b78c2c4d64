"""The long chunks of a step on the torch path (long_chunks.py): every path (oneDNN GEMMs per
KV head, batched GEMMs, SDPA) against a naive dense attention, and which chunks take which."""

from __future__ import annotations

import pytest
import torch

from constrained_serve.kernels import long_chunks, onednn

from .helpers import assert_matches_dense, paged_case

# The two storage orders of the page pool (kv_layout.py): page-major as on GPU, head-major as on CPU.
LAYOUTS = pytest.mark.parametrize("head_major", [False, True], ids=["page-major", "head-major"])


# Long chunks (> SHORT_CHUNK tokens): a whole prompt, a chunk after a cached prefix ending
# mid-page, beside decodes and a short forced chunk.
LONG = ([1, 1, 40, 23, 3, 70], [30, 5, 40, 57, 19, 100])


@pytest.mark.parametrize("path", ["per_head", "batched", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@LAYOUTS
def test_long_chunks_match_dense(monkeypatch, path, dtype, head_major):
    """Every long-chunk path: oneDNN GEMMs per KV head (CPU), the batched GEMMs and, for
    large score matrices, SDPA."""
    if path == "per_head" and not onednn.supports(dtype):
        # An AVX2-only CPU: oneDNN builds no bf16 inner product, so the chunks take the
        # batched GEMMs instead (checked below, and against the dense reference).
        assert not long_chunks.per_head_onednn(dtype, torch.device("cpu"))
        path = "batched"
    if path == "per_head":
        assert long_chunks.per_head_onednn(dtype, torch.device("cpu")), "oneDNN matmul missing from this torch"
        monkeypatch.setattr(long_chunks, "MIN_HEAD_SCORES", 0)  # the test's chunks are small
        monkeypatch.setattr(long_chunks, "HEAD_BLOCK_ROWS", 7)  # several blocks, not a multiple of G
    else:
        monkeypatch.setattr(long_chunks, "per_head_onednn", lambda dtype, device: False)
    if path == "sdpa":
        monkeypatch.setattr(long_chunks, "MAX_GEMM_SCORES", 0)
    q, kc, vc, meta, kf, vf = paged_case(*LONG, group=3, hkv=2, dtype=dtype, head_major=head_major)
    plans = long_chunks.long_chunks(meta, 16, 2, 3, q.device, dtype)
    assert len(plans) == 3 and all((p.bias is not None) == (path != "sdpa") for p in plans)
    assert all(p.per_head == (path == "per_head") for p in plans)
    assert_matches_dense(q, kc, vc, meta, kf, vf)


def test_per_head_path_takes_chunks_too_large_for_the_batched_one(monkeypatch):
    """The per-head path bounds memory by one head's scores: a chunk over the batched limit
    stays on it, and goes to SDPA only past the per-head limit."""
    q, kc, vc, meta, kf, vf = paged_case(*LONG, group=3, hkv=2, dtype=torch.float32, head_major=True)
    monkeypatch.setattr(long_chunks, "MAX_GEMM_SCORES", 0)
    monkeypatch.setattr(long_chunks, "MIN_HEAD_SCORES", 0)
    assert all(p.per_head for p in long_chunks.long_chunks(meta, 16, 2, 3, q.device, torch.float32))
    meta.plan_cache.clear()
    monkeypatch.setattr(long_chunks, "MAX_HEAD_SCORES", 0)
    assert all(p.bool_mask is not None for p in long_chunks.long_chunks(meta, 16, 2, 3, q.device, torch.float32))
    assert_matches_dense(q, kc, vc, meta, kf, vf)


def test_small_chunks_stay_batched():
    """Below MIN_HEAD_SCORES the batched GEMMs are as fast or faster, and keep them."""
    q, kc, vc, meta, kf, vf = paged_case(*LONG, group=3, hkv=2, dtype=torch.float32, head_major=True)
    plans = long_chunks.long_chunks(meta, 16, 2, 3, q.device, torch.float32)
    assert plans and not any(p.per_head for p in plans) and all(p.bias is not None for p in plans)
    # fp16 (no fast oneDNN path without avx512_fp16) and other devices never take it.
    assert not long_chunks.per_head_onednn(torch.float16, torch.device("cpu"))
    assert not long_chunks.per_head_onednn(torch.float32, torch.device("meta"))
