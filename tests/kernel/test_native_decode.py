"""The native CPU attention of short rows (kernels/paged_decode_cpu.c via native_decode.py):
decode rows and the tokens of short chunks, in fp32 and bf16. The same results as the float64
reference and as the torch path, its fallbacks, and the huge-page advice on the CPU pool it
reads."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from constrained_serve.kernels import attention, kv_layout, native_build, native_decode, short_rows

from .helpers import assert_matches_dense, paged_case

# The OpenMP loops of the native code on two threads (the suite's default is one).
pytestmark = pytest.mark.usefixtures("two_threads")


def _torch_path(q, kc, vc, meta, scale, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(native_decode, "supports", lambda *a: False)
        meta.plan_cache.clear()
        out = attention.paged_attention_torch(q, kc, vc, meta, scale)
    meta.plan_cache.clear()
    return out


def _lengths(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice([1, 2, 15, 16, 17, 31, 33, 64, 100, 257]) for _ in range(n)]


@pytest.mark.parametrize(
    "hkv,group,d,page_size",
    [
        (3, 3, 64, 16),  # SmolLM2-135M: a compiled-in instance
        (2, 4, 128, 16),  # Llama-3 shapes
        (1, 1, 64, 8),
        (2, 5, 32, 4),  # the generic code path (group and head_dim not compiled in)
        (1, 16, 256, 128),  # every limit at once
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_decode_rows_match_the_dense_reference(hkv, group, d, page_size, dtype):
    lens = _lengths(12, seed=hkv * 100 + group)
    q, kc, vc, meta, kf, vf = paged_case(
        [1] * len(lens), lens, page_size=page_size, hkv=hkv, group=group, d=d, head_major=True, dtype=dtype
    )
    assert native_decode.library() is not None, "the native kernel did not build: it needs a C compiler (cc, gcc)"
    assert native_decode.supports(q, kc, vc)
    assert_matches_dense(q, kc, vc, meta, kf, vf, scale=d**-0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_chunk_tokens_see_the_keys_up_to_their_own_position(dtype):
    """Chunks of 2..MAX_CHUNK tokens (forced tokens after a decode), ending anywhere in a page
    or on its edge: each token is its own row, causally cut. The kernel alone writes them."""
    qlens = [2, 3, 4, 4, 3, 2, 4]
    lens = [2, 17, 16, 40, 33, 100, 64]
    assert max(qlens) == native_decode.MAX_CHUNK
    q, kc, vc, meta, kf, vf = paged_case(qlens, lens, hkv=2, group=4, d=128, head_major=True, dtype=dtype)
    assert native_decode.supports(q, kc, vc)
    out = torch.full_like(q, float("nan"))
    native_decode.attend_rows(q, kc, vc, meta, 128**-0.5, out)
    assert_matches_dense(q, kc, vc, meta, kf, vf, scale=128**-0.5, out=out)


def test_each_short_row_is_attended_once():
    """The native kernel takes rows of up to MAX_CHUNK tokens, the torch path's short groups
    the rest up to SHORT_CHUNK: no token is left out or attended twice."""
    qlens = [1, 1, 2, 4, 5, 16, 1, 3]
    q, kc, vc, meta, *_ = paged_case(qlens, [10, 30, 20, 40, 33, 60, 17, 50], hkv=2, group=2, head_major=True)
    starts = meta.query_starts_host
    native = native_decode._rows(meta, kc.shape[0], kc.shape[1])[1].tolist()
    torch_path = [
        t
        for g in short_rows.short_groups(meta, 16, 2, q.device, native_decode.MAX_CHUNK + 1)
        for t in g.out_index.tolist()
    ]
    assert sorted(native) == [starts[b] + j for b, n in enumerate(qlens) if n <= 4 for j in range(n)]
    assert sorted(torch_path) == [starts[b] + j for b, n in enumerate(qlens) if 4 < n <= 16 for j in range(n)]


def test_bf16_rows_are_the_fp32_rows_rounded_to_nearest_even():
    """The bf16 instance widens on load and sums in fp32 like the fp32 one, so on the same
    (bf16-representable) values its output is the fp32 output rounded as torch rounds."""
    qlens, lens = [1, 1, 1, 4, 1], [7, 16, 90, 40, 33]
    q, kc, vc, meta, *_ = paged_case(qlens, lens, hkv=3, group=3, head_major=True, dtype=torch.bfloat16)
    out16, out32 = torch.empty_like(q), torch.empty(q.shape)
    native_decode.attend_rows(q, kc, vc, meta, 0.125, out16)
    native_decode.attend_rows(q.float(), kc.float(), vc.float(), meta, 0.125, out32)
    assert torch.equal(out16, out32.bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_and_torch_paths_agree_on_a_mixed_batch(monkeypatch, dtype):
    """Decodes and chunks of up to 4 tokens (native) beside longer short chunks and a long
    chunk (torch path), and 1-token chunks after a chunk (decode rows that are not at the front
    of the batch)."""
    decodes = _lengths(9, seed=7)
    qlens = [1] * 9 + [3, 1, 5, 1, 40, 16, 17]
    lens = decodes + [20, 33, 16, 70, 90, 50, 60]
    q, kc, vc, meta, kf, vf = paged_case(qlens, lens, hkv=3, group=3, head_major=True, dtype=dtype)
    assert native_decode.supports(q, kc, vc)
    native = attention.paged_attention_torch(q, kc, vc, meta, 0.125)
    # Both paths sum in fp32; bf16 outputs may differ by one rounding step (2^-8 relative).
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(native, _torch_path(q, kc, vc, meta, 0.125, monkeypatch), atol=tol, rtol=tol)
    assert_matches_dense(q, kc, vc, meta, kf, vf)


def test_native_decode_reads_shared_prefix_pages():
    """Rows whose first pages are one cached prefix (the torch path's cascade case)."""
    lens = [40, 41, 60, 75, 33, 90]
    q, kc, vc, meta, kf, vf = paged_case([1] * 6, lens, hkv=2, group=3, head_major=True, shared_pages=2)
    assert native_decode.supports(q, kc, vc)
    assert_matches_dense(q, kc, vc, meta, kf, vf)


def test_torch_path_where_the_kernel_does_not_apply():
    q, kc, vc, *_ = paged_case([1, 1], [5, 20], hkv=2, group=2, head_major=True, dtype=torch.float16)
    assert not native_decode.supports(q, kc, vc)  # fp32 and bf16 only
    q, kc, vc, *_ = paged_case([1, 1], [5, 20], hkv=2, group=2, head_major=True)
    assert not native_decode.supports(q.bfloat16(), kc, vc)  # q and the pool in different dtypes
    q, kc, vc, *_ = paged_case([1, 1], [5, 20], hkv=2, group=2, head_major=False)
    assert not native_decode.supports(q, kc, vc)  # a contiguous (GPU-layout) pool
    q, kc, vc, *_ = paged_case([1], [5], hkv=1, group=17, d=16, head_major=True)
    assert not native_decode.supports(q, kc, vc)  # past the kernel's GQA group limit


@pytest.mark.parametrize("how", ["no compiler", "switched off"])
def test_without_the_kernel_the_torch_path_runs(how, monkeypatch, caplog):
    native_decode.LIBRARY.reset()
    if how == "no compiler":
        monkeypatch.setenv("CC", "/nonexistent/cc")
    else:
        monkeypatch.setenv(native_decode.ENV_SWITCH, "0")
    q, kc, vc, meta, kf, vf = paged_case([1] * 4, [3, 16, 17, 50], hkv=2, group=3, head_major=True)
    try:
        with caplog.at_level(logging.INFO, logger=native_build.__name__):
            assert native_decode.library() is None
            assert not native_decode.supports(q, kc, vc)
        assert ("failed" if how == "no compiler" else "off") in caplog.text
        assert_matches_dense(q, kc, vc, meta, kf, vf)
    finally:
        native_decode.LIBRARY.reset()  # the next test builds it again, with the real compiler


def _pool_mapping(pool: torch.Tensor) -> dict:
    """The /proc/self/smaps entry of the mapping that holds the pool: its Rss (kB) and VmFlags."""
    base = kv_layout.heads_view(pool).data_ptr()
    inside = -(-base // (2 << 20)) * (2 << 20)  # the first 2 MiB boundary in the pool
    entry, current = {}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                current = lo <= inside < hi
            elif current and line.startswith("Rss:"):
                entry["rss_kb"] = int(line.split()[1])
            elif current and line.startswith("VmFlags:"):
                entry["flags"] = line.split()[1:]
                break
    assert "flags" in entry, "the pool's mapping was not found in /proc/self/smaps"
    return entry


def test_cpu_pool_is_zeroed_lazily_and_advised_huge_pages():
    """An anonymous private map: nothing resident until written (an engine starts without
    touching its pool), zeros when read, and advised 2 MiB pages."""
    pool = kv_layout.allocate_pool(1024, 16, 3, 64, torch.float32, torch.device("cpu"), head_major=True)
    size_kb = kv_layout.heads_view(pool).nbytes // 1024
    untouched = _pool_mapping(pool)
    assert untouched["rss_kb"] < size_kb // 10, f"{untouched['rss_kb']} of {size_kb} kB resident before any write"
    assert pool.abs().sum() == 0
    pool.fill_(1.0)
    written = _pool_mapping(pool)
    assert written["rss_kb"] >= size_kb * 9 // 10
    flags = written["flags"]
    assert "hg" in flags, f"the pool's mapping is not advised huge pages: {flags}"


def test_tables_pointing_out_of_the_pool_are_refused():
    """Native code reads where the block tables point: out-of-range ids raise instead."""
    q, kc, vc, meta, *_ = paged_case([1, 1], [5, 20], hkv=2, group=2, head_major=True)
    meta.block_tables[1, 0] = kc.shape[0]  # one past the pool's last page
    with pytest.raises(RuntimeError, match="out of range"):
        native_decode.attend_rows(q, kc, vc, meta, 0.125, torch.empty_like(q))
