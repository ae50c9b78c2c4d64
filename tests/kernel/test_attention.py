"""Paged attention and KV store: torch reference vs a naive dense attention, Triton vs the
reference (under TRITON_INTERPRET=1 on CPU, on the real device in benchmarks/gpu_check.sh)."""

from __future__ import annotations

import pytest
import torch

from constrained_serve.kernels import attention as A
from constrained_serve.kernels import kv_layout, long_chunks, short_rows

from .helpers import dense_causal_attention, make_batch, require_triton

# (query_lens, seq_lens): decodes first. Lengths end mid-page, on a page boundary (16, 32,
# 64), a chunk that is the whole prompt, a chunk after a cached prefix, and a 1-token prompt.
MIXED = ([1, 1, 1, 5, 16, 7], [1, 16, 33, 21, 16, 64])
PREFILL_ONLY = ([9, 32, 1], [9, 40, 1])
DECODE_ONLY = ([1, 1, 1, 1], [1, 17, 32, 75])


# The two storage orders of the page pool (kv_layout.py): page-major as on GPU, head-major as on CPU.
LAYOUTS = pytest.mark.parametrize("head_major", [False, True], ids=["page-major", "head-major"])


def _paged_case(
    query_lens,
    seq_lens,
    *,
    page_size=16,
    hkv=2,
    group=2,
    d=64,
    dtype=torch.float32,
    seed=0,
    head_major=False,
    shared_pages=0,
):
    """Writes each sequence's full K/V history into the pages via store_kv_torch.
    shared_pages: all sequences start with the same pages, holding the same keys (make_batch)."""
    g = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-L // page_size) for L in seq_lens) + 3
    meta = make_batch(query_lens, seq_lens, page_size, num_pages, g, shared_pages=shared_pages)
    k_cache = kv_layout.allocate_pool(num_pages, page_size, hkv, d, dtype, torch.device("cpu"), head_major)
    v_cache = kv_layout.allocate_pool(num_pages, page_size, hkv, d, dtype, torch.device("cpu"), head_major)
    assert (kv_layout.heads_view(k_cache) is not None) == (head_major or hkv == 1)  # one head: both orders agree
    # Garbage in unused slots: attention must never read it.
    k_cache.copy_(torch.randn(k_cache.shape, generator=g))
    v_cache.copy_(torch.randn(v_cache.shape, generator=g))
    k_full, v_full = [], []
    for b, L in enumerate(seq_lens):
        k = torch.randn(L, hkv, d, generator=g).to(dtype)
        v = torch.randn(L, hkv, d, generator=g).to(dtype)
        if b and shared_pages:  # the shared prefix holds the same keys for everyone
            k[: shared_pages * page_size] = k_full[0][: shared_pages * page_size]
            v[: shared_pages * page_size] = v_full[0][: shared_pages * page_size]
        pages = meta.block_tables[b, : -(-L // page_size)].long()
        slots = (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)[:L]
        A.store_kv_torch(k, v, k_cache, v_cache, slots)
        k_full.append(k)
        v_full.append(v)
    q = torch.randn(sum(query_lens), hkv * group, d, generator=g).to(dtype)
    return q, k_cache, v_cache, meta, k_full, v_full


def _assert_matches_dense(q, kc, vc, meta, kf, vf, scale=0.125):
    """The torch path against the float64 loop reference, at the tolerance of q's dtype."""
    tol = 1e-5 if q.dtype == torch.float32 else 3e-2
    torch.testing.assert_close(
        A.paged_attention_torch(q, kc, vc, meta, scale).double(),
        dense_causal_attention(q, kf, vf, meta, scale),
        atol=tol,
        rtol=tol,
    )


@pytest.mark.parametrize("case", [MIXED, PREFILL_ONLY, DECODE_ONLY], ids=["mixed", "prefill", "decode"])
@pytest.mark.parametrize("group", [1, 4])
@LAYOUTS
def test_reference_matches_dense(case, group, head_major):
    q, kc, vc, meta, kf, vf = _paged_case(*case, group=group, head_major=head_major)
    _assert_matches_dense(q, kc, vc, meta, kf, vf, scale=64**-0.5)


def test_reference_length_buckets_match_dense():
    """Many decode rows of very different lengths (shuffled) take the bucketed gather path."""
    import random

    rng = random.Random(3)
    lens = [rng.choice([1, 15, 16, 17, 40, 64, 90, 130]) for _ in range(40)] + [3, 7]
    q, kc, vc, meta, kf, vf = _paged_case([1] * 40 + [3, 7], lens, group=3, hkv=1)
    assert len(short_rows._length_buckets(meta.seq_lens_host[:40])) > 1
    _assert_matches_dense(q, kc, vc, meta, kf, vf)


# Long chunks (> SHORT_CHUNK tokens): a whole prompt, a chunk after a cached prefix ending
# mid-page, beside decodes and a short forced chunk.
LONG = ([1, 1, 40, 23, 3, 70], [30, 5, 40, 57, 19, 100])


@pytest.mark.parametrize("path", ["per_head", "batched", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@LAYOUTS
def test_long_chunks_match_dense(monkeypatch, path, dtype, head_major):
    """Every long-chunk path: oneDNN GEMMs per KV head (CPU), the batched GEMMs and, for
    large score matrices, SDPA."""
    if path == "per_head":
        assert long_chunks.per_head_onednn(dtype, torch.device("cpu")), "oneDNN matmul missing from this torch"
        monkeypatch.setattr(long_chunks, "MIN_HEAD_SCORES", 0)  # the test's chunks are small
        monkeypatch.setattr(long_chunks, "HEAD_BLOCK_ROWS", 7)  # several blocks, not a multiple of G
    else:
        monkeypatch.setattr(long_chunks, "per_head_onednn", lambda dtype, device: False)
    if path == "sdpa":
        monkeypatch.setattr(long_chunks, "MAX_GEMM_SCORES", 0)
    q, kc, vc, meta, kf, vf = _paged_case(*LONG, group=3, hkv=2, dtype=dtype, head_major=head_major)
    plans = long_chunks.long_chunks(meta, 16, 2, 3, q.device, dtype)
    assert len(plans) == 3 and all((p.bias is not None) == (path != "sdpa") for p in plans)
    assert all(p.per_head == (path == "per_head") for p in plans)
    _assert_matches_dense(q, kc, vc, meta, kf, vf)


def test_per_head_path_takes_chunks_too_large_for_the_batched_one(monkeypatch):
    """The per-head path bounds memory by one head's scores: a chunk over the batched limit
    stays on it, and goes to SDPA only past the per-head limit."""
    q, kc, vc, meta, kf, vf = _paged_case(*LONG, group=3, hkv=2, dtype=torch.float32, head_major=True)
    monkeypatch.setattr(long_chunks, "MAX_GEMM_SCORES", 0)
    monkeypatch.setattr(long_chunks, "MIN_HEAD_SCORES", 0)
    assert all(p.per_head for p in long_chunks.long_chunks(meta, 16, 2, 3, q.device, torch.float32))
    meta.plan_cache.clear()
    monkeypatch.setattr(long_chunks, "MAX_HEAD_SCORES", 0)
    assert all(p.bool_mask is not None for p in long_chunks.long_chunks(meta, 16, 2, 3, q.device, torch.float32))
    _assert_matches_dense(q, kc, vc, meta, kf, vf)


def test_small_chunks_stay_batched():
    """Below MIN_HEAD_SCORES the batched GEMMs are as fast or faster, and keep them."""
    q, kc, vc, meta, kf, vf = _paged_case(*LONG, group=3, hkv=2, dtype=torch.float32, head_major=True)
    plans = long_chunks.long_chunks(meta, 16, 2, 3, q.device, torch.float32)
    assert plans and not any(p.per_head for p in plans) and all(p.bias is not None for p in plans)
    # fp16 (no fast oneDNN path without avx512_fp16) and other devices never take it.
    assert not long_chunks.per_head_onednn(torch.float16, torch.device("cpu"))
    assert not long_chunks.per_head_onednn(torch.float32, torch.device("meta"))


def test_reference_tolerates_padded_block_tables():
    q, kc, vc, meta, kf, vf = _paged_case(*DECODE_ONLY)
    bt = meta.block_tables.clone()
    for b, L in enumerate(meta.seq_lens_host):
        bt[b, -(-L // 16) :] = -1
    meta.block_tables = bt
    _assert_matches_dense(q, kc, vc, meta, kf, vf)


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
    q, kc, vc, meta, kf, vf = _paged_case(*case, page_size=page_size, hkv=hkv, group=group, d=d, dtype=dtype, seed=3)
    scale = d**-0.5
    ref = A.paged_attention_torch(q, kc, vc, meta, scale)
    out = A.paged_attention_triton(q, kc, vc, meta, scale, num_splits=1)
    assert out.dtype == dtype and out.shape == q.shape
    tol = _TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_triton_attention_small_query_blocks():
    """A chunk longer than one query block: several programs per sequence."""
    require_triton()
    q, kc, vc, meta, _, _ = _paged_case(*MIXED, group=2, seed=4)
    ref = A.paged_attention_torch(q, kc, vc, meta, 0.125)
    out = A.paged_attention_triton(q, kc, vc, meta, 0.125, block_m=8, block_n=32)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_split_decode_matches_reference(num_splits, dtype):
    require_triton()
    # 75 keys in 8 splits of 16-key tiles: some splits are empty and must not count.
    q, kc, vc, meta, _, _ = _paged_case(*DECODE_ONLY, group=4, dtype=dtype, seed=5)
    ref = A.paged_attention_torch(q, kc, vc, meta, 0.125)
    out = A.paged_attention_triton(q, kc, vc, meta, 0.125, num_splits=num_splits)
    tol = _TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_split_decodes_inside_a_mixed_batch():
    """An explicit num_splits splits the decode rows; the prefill chunks run unsplit."""
    require_triton()
    q, kc, vc, meta, _, _ = _paged_case(*MIXED, seed=6)
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@LAYOUTS
def test_reference_batches_short_chunks_with_padding(dtype, head_major):
    """Short chunks (forced tokens after decoding) of several lengths, among decodes and a long
    chunk: batched in one GEMM pair per length bucket, queries padded to the longest chunk.
    1-token chunks after the leading decodes join the decode rows, unpadded."""
    import random

    rng = random.Random(5)
    decodes = [rng.choice([3, 16, 17, 50]) for _ in range(5)]
    chunks = [(n, n + rng.choice([0, 1, 15, 16, 40])) for n in [2, 3, 5, 16, 1, 7] * 6]
    qlens = [1] * 5 + [n for n, _ in chunks] + [40]
    lens = decodes + [L for _, L in chunks] + [70]
    q, kc, vc, meta, kf, vf = _paged_case(qlens, lens, group=3, hkv=2, dtype=dtype, head_major=head_major)
    groups = short_rows.short_groups(meta, 16, 3, q.device)
    assert sum(g.bias.shape[0] for g in groups) == 5 + len(chunks)  # every short row batched
    assert any(g.nmax == 16 for g in groups) and any(g.out_select is not None for g in groups)
    assert sum(g.bias.shape[0] for g in groups if g.nmax == 1) == qlens.count(1)
    _assert_matches_dense(q, kc, vc, meta, kf, vf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@LAYOUTS
def test_short_rows_attend_a_shared_prefix_once(dtype, head_major):
    """Decode rows and forced chunks whose first 6 pages are the same (a cached system prompt):
    the shared keys are gathered once and attended in one GEMM per KV head; still exact."""
    import random

    rng = random.Random(11)
    qlens = [1] * 20 + [rng.randint(2, 9) for _ in range(12)] + [30]
    lens = [rng.randint(97, 170) + n for n in qlens]
    q, kc, vc, meta, kf, vf = _paged_case(
        qlens, lens, group=3, hkv=2, dtype=dtype, head_major=head_major, shared_pages=6
    )
    groups = short_rows.short_groups(meta, 16, 3, q.device)
    assert [g.shared_pages.numel() for g in groups] == [6, 6]
    assert torch.equal(groups[0].shared_pages.int(), meta.block_tables[0, :6])
    _assert_matches_dense(q, kc, vc, meta, kf, vf)


def test_shared_prefix_stops_where_a_query_would_not_see_it():
    """A shared page is attended in the shared GEMM only if every query of the group sees all of
    its keys; otherwise the rows gather it themselves (and the mask hides what it must)."""
    table = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 9]])
    assert short_rows._shared_pages(table, [1, 1], [60, 50], 16) == 3  # 3 pages common
    assert short_rows._shared_pages(table, [1, 12], [60, 50], 16) == 2  # position 38 sees 39 keys < 48
    assert short_rows._shared_pages(table, [1, 1], [60, 20], 16) == 0  # 1 page: below MIN_SHARED_PAGES
    assert short_rows._shared_pages(table[:1], [1], [60], 16) == 0  # one row: nothing to share
