"""Paged attention and KV store (attention.py): the torch reference vs a naive dense attention,
the Triton kernels it re-exports (attention_triton.py, decode_split_triton.py) vs the
reference (under TRITON_INTERPRET=1 on CPU, on the real device in benchmarks/gpu_check.sh)."""

from __future__ import annotations

import pytest
import torch

from constrained_serve.kernels import attention as A
from constrained_serve.kernels import kv_layout

from .helpers import assert_matches_dense, make_batch, paged_case, require_triton

# (query_lens, seq_lens): decodes first. Lengths end mid-page, on a page boundary (16, 32,
# 64), a chunk that is the whole prompt, a chunk after a cached prefix, and a 1-token prompt.
MIXED = ([1, 1, 1, 5, 16, 7], [1, 16, 33, 21, 16, 64])
PREFILL_ONLY = ([9, 32, 1], [9, 40, 1])
DECODE_ONLY = ([1, 1, 1, 1], [1, 17, 32, 75])


# The two storage orders of the page pool (kv_layout.py): page-major as on GPU, head-major as on CPU.
LAYOUTS = pytest.mark.parametrize("head_major", [False, True], ids=["page-major", "head-major"])


@pytest.mark.parametrize("case", [MIXED, PREFILL_ONLY, DECODE_ONLY], ids=["mixed", "prefill", "decode"])
@pytest.mark.parametrize("group", [1, 4])
@LAYOUTS
def test_reference_matches_dense(case, group, head_major):
    q, kc, vc, meta, kf, vf = paged_case(*case, group=group, head_major=head_major)
    assert_matches_dense(q, kc, vc, meta, kf, vf, scale=64**-0.5)


def test_reference_tolerates_padded_block_tables():
    q, kc, vc, meta, kf, vf = paged_case(*DECODE_ONLY)
    bt = meta.block_tables.clone()
    for b, L in enumerate(meta.seq_lens_host):
        bt[b, -(-L // 16) :] = -1
    meta.block_tables = bt
    assert_matches_dense(q, kc, vc, meta, kf, vf)


@LAYOUTS
def test_store_kv_reference_writes_slots(head_major):
    g = torch.Generator().manual_seed(1)
    kc = kv_layout.allocate_pool(4, 16, 2, 8, torch.float32, torch.device("cpu"), head_major)
    vc = kv_layout.allocate_pool(4, 16, 2, 8, torch.float32, torch.device("cpu"), head_major)
    k, v = torch.randn(3, 2, 8, generator=g), torch.randn(3, 2, 8, generator=g)
    slots = torch.tensor([5, 16 * 3 + 15, 16], dtype=torch.int64)
    A.store_kv_torch(k, v, kc, vc, slots)
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(kc[s // 16, s % 16], k[i]) and torch.equal(vc[s // 16, s % 16], v[i])
    assert int((kc != 0).any(-1).any(-1).sum()) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_store_kv_triton_matches_reference(dtype):
    require_triton()
    g = torch.Generator().manual_seed(2)
    num_pages, ps, hkv, d = 6, 16, 3, 64  # 3 heads: exercises the padded head block
    k, v = torch.randn(10, hkv, d, generator=g), torch.randn(10, hkv, d, generator=g)
    if dtype == torch.bfloat16:
        # The engine hands K/V over in the cache dtype. (The interpreter's fp32 -> bf16 cast
        # truncates where the GPU rounds, so a converting store is not bit-comparable there.)
        k, v = k.to(dtype), v.to(dtype)
    slots = torch.randperm(num_pages * ps, generator=g)[:10]
    ref_k = torch.randn(num_pages, ps, hkv, d, generator=g).to(dtype)
    ref_v = torch.randn(num_pages, ps, hkv, d, generator=g).to(dtype)
    tri_k, tri_v = ref_k.clone(), ref_v.clone()
    A.store_kv_torch(k, v, ref_k, ref_v, slots)
    A.store_kv_triton(k, v, tri_k, tri_v, slots)
    assert torch.equal(ref_k, tri_k) and torch.equal(ref_v, tri_v)
    # A padding slot (-1) writes nothing.
    before = tri_k.clone()
    A.store_kv_triton(k[:2], v[:2], tri_k, tri_v, torch.tensor([-1, -1]))
    assert torch.equal(before, tri_k)


_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}

TRITON_CASES = [
    # (case, page_size, hkv, group, head_dim, dtype)
    (MIXED, 16, 2, 1, 64, torch.float32),
    (MIXED, 16, 2, 4, 64, torch.float16),
    (MIXED, 32, 1, 2, 128, torch.bfloat16),
    (PREFILL_ONLY, 16, 2, 2, 64, torch.float32),
    (PREFILL_ONLY, 128, 2, 3, 64, torch.float16),
    (DECODE_ONLY, 16, 2, 4, 128, torch.float32),
    (DECODE_ONLY, 64, 1, 8, 64, torch.bfloat16),
]


@pytest.mark.parametrize("case,page_size,hkv,group,d,dtype", TRITON_CASES)
def test_triton_attention_matches_reference(case, page_size, hkv, group, d, dtype):
    require_triton()
    q, kc, vc, meta, kf, vf = paged_case(*case, page_size=page_size, hkv=hkv, group=group, d=d, dtype=dtype, seed=3)
    scale = d**-0.5
    ref = A.paged_attention_torch(q, kc, vc, meta, scale)
    out = A.paged_attention_triton(q, kc, vc, meta, scale, num_splits=1)
    assert out.dtype == dtype and out.shape == q.shape
    tol = _TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_triton_attention_small_query_blocks():
    """A chunk longer than one query block: several programs per sequence."""
    require_triton()
    q, kc, vc, meta, _, _ = paged_case(*MIXED, group=2, seed=4)
    ref = A.paged_attention_torch(q, kc, vc, meta, 0.125)
    out = A.paged_attention_triton(q, kc, vc, meta, 0.125, block_m=8, block_n=32)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_split_decode_matches_reference(num_splits, dtype):
    require_triton()
    # 75 keys in 8 splits of 16-key tiles: some splits are empty and must not count.
    q, kc, vc, meta, _, _ = paged_case(*DECODE_ONLY, group=4, dtype=dtype, seed=5)
    ref = A.paged_attention_torch(q, kc, vc, meta, 0.125)
    out = A.paged_attention_triton(q, kc, vc, meta, 0.125, num_splits=num_splits)
    tol = _TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_split_decodes_inside_a_mixed_batch():
    """An explicit num_splits splits the decode rows; the prefill chunks run unsplit."""
    require_triton()
    q, kc, vc, meta, _, _ = paged_case(*MIXED, seed=6)
    ref = A.paged_attention_torch(q, kc, vc, meta, 0.125)
    out = A.paged_attention_triton(q, kc, vc, meta, 0.125, num_splits=4)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@LAYOUTS
def test_store_then_attend_triton_end_to_end(head_major):
    """One step as the engine runs it: store this step's K/V, then attend over the pages.
    Triton uses the given storage order (its kernels take strides), the reference the other."""
    require_triton()
    g = torch.Generator().manual_seed(7)
    query_lens, seq_lens, ps, hkv, group, d = [1, 1, 6], [9, 16, 6], 16, 2, 2, 64
    meta = make_batch(query_lens, seq_lens, ps, 8, g)
    cpu = torch.device("cpu")
    kc_ref, vc_ref, kc, vc = (
        kv_layout.allocate_pool(8, ps, hkv, d, torch.float32, cpu, m)
        for m in (not head_major, not head_major, head_major, head_major)
    )
    for ref, tri in ((kc_ref, kc), (vc_ref, vc)):
        ref.copy_(torch.randn(ref.shape, generator=g))
        tri.copy_(ref)
    T = sum(query_lens)
    k_new, v_new = torch.randn(T, hkv, d, generator=g), torch.randn(T, hkv, d, generator=g)
    q = torch.randn(T, hkv * group, d, generator=g)
    A.store_kv_torch(k_new, v_new, kc_ref, vc_ref, meta.slot_mapping)
    A.store_kv_triton(k_new, v_new, kc, vc, meta.slot_mapping)
    ref = A.paged_attention_torch(q, kc_ref, vc_ref, meta, 0.125)
    out = A.paged_attention_triton(q, kc, vc, meta, 0.125)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_default_num_splits_uses_host_sizes_only():
    g = torch.Generator().manual_seed(8)
    long_decodes = make_batch([1, 1], [4000, 3000], 16, 512, g)
    assert A.default_num_splits(long_decodes, num_kv_heads=8) > 1
    short = make_batch([1, 1], [20, 30], 16, 8, g)
    assert A.default_num_splits(short, num_kv_heads=8) == 1
    mixed = make_batch([1, 5], [4000, 5], 16, 512, g)
    assert A.default_num_splits(mixed, num_kv_heads=8) == 1
