"""The short rows of a step on the torch path (short_rows.py): decodes and short forced chunks
batched per length bucket (queries padded), a shared prefix attended once, each against a
naive dense attention."""

from __future__ import annotations

import pytest
import torch

from constrained_serve.kernels import short_rows

from .helpers import assert_matches_dense, paged_case

# The two storage orders of the page pool (kv_layout.py): page-major as on GPU, head-major as on CPU.
LAYOUTS = pytest.mark.parametrize("head_major", [False, True], ids=["page-major", "head-major"])


def test_reference_length_buckets_match_dense():
    """Many decode rows of very different lengths (shuffled) take the bucketed gather path."""
    import random

    rng = random.Random(3)
    lens = [rng.choice([1, 15, 16, 17, 40, 64, 90, 130]) for _ in range(40)] + [3, 7]
    q, kc, vc, meta, kf, vf = paged_case([1] * 40 + [3, 7], lens, group=3, hkv=1)
    assert len(short_rows._length_buckets(meta.seq_lens_host[:40])) > 1
    assert_matches_dense(q, kc, vc, meta, kf, vf)


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
    q, kc, vc, meta, kf, vf = paged_case(qlens, lens, group=3, hkv=2, dtype=dtype, head_major=head_major)
    groups = short_rows.short_groups(meta, 16, 3, q.device)
    assert sum(g.bias.shape[0] for g in groups) == 5 + len(chunks)  # every short row batched
    assert any(g.nmax == 16 for g in groups) and any(g.out_select is not None for g in groups)
    assert sum(g.bias.shape[0] for g in groups if g.nmax == 1) == qlens.count(1)
    assert_matches_dense(q, kc, vc, meta, kf, vf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@LAYOUTS
def test_short_rows_attend_a_shared_prefix_once(dtype, head_major):
    """Decode rows and forced chunks whose first 6 pages are the same (a cached system prompt):
    the shared keys are gathered once and attended in one GEMM per KV head; still exact."""
    import random

    rng = random.Random(11)
    qlens = [1] * 20 + [rng.randint(2, 9) for _ in range(12)] + [30]
    lens = [rng.randint(97, 170) + n for n in qlens]
    q, kc, vc, meta, kf, vf = paged_case(
        qlens, lens, group=3, hkv=2, dtype=dtype, head_major=head_major, shared_pages=6
    )
    groups = short_rows.short_groups(meta, 16, 3, q.device)
    assert [g.shared_pages.numel() for g in groups] == [6, 6]
    assert torch.equal(groups[0].shared_pages.int(), meta.block_tables[0, :6])
    assert_matches_dense(q, kc, vc, meta, kf, vf)


def test_shared_prefix_stops_where_a_query_would_not_see_it():
    """A shared page is attended in the shared GEMM only if every query of the group sees all of
    its keys; otherwise the rows gather it themselves (and the mask hides what it must)."""
    table = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 9]])
    assert short_rows._shared_pages(table, [1, 1], [60, 50], 16) == 3  # 3 pages common
    assert short_rows._shared_pages(table, [1, 12], [60, 50], 16) == 2  # position 38 sees 39 keys < 48
    assert short_rows._shared_pages(table, [1, 1], [60, 20], 16) == 0  # 1 page: below MIN_SHARED_PAGES
    assert short_rows._shared_pages(table[:1], [1], [60], 16) == 0  # one row: nothing to share
