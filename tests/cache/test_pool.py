from __future__ import annotations

import pytest

from constrained_serve.cache.pool import OutOfPages, PagePool


def test_allocate_gives_low_ids_with_ref_one() -> None:
    pool = PagePool(4, 2)
    pages = pool.allocate(2)
    assert pages == [0, 1]
    assert [pool.ref_count(p) for p in range(4)] == [1, 1, 0, 0]
    assert pool.num_free == 2
    pool.check_integrity()


def test_out_of_pages_takes_nothing() -> None:
    pool = PagePool(3, 1)
    pool.allocate(2)
    with pytest.raises(OutOfPages):
        pool.allocate(2)
    assert pool.num_free == 1
    pool.check_integrity()


def test_page_is_freed_only_when_last_ref_drops() -> None:
    pool = PagePool(2, 4)
    (p,) = pool.allocate(1)
    pool.incref([p])
    pool.decref([p])
    assert pool.ref_count(p) == 1 and pool.num_free == 1
    pool.decref([p])
    assert pool.ref_count(p) == 0 and pool.num_free == 2
    pool.check_integrity()
    # A freed page is handed out again.
    assert p in pool.allocate(2)


def test_incref_or_decref_of_free_page_is_a_bug() -> None:
    pool = PagePool(2, 1)
    with pytest.raises(AssertionError):
        pool.incref([0])
    with pytest.raises(AssertionError):
        pool.decref([0])


@pytest.mark.parametrize("num_pages,page_size", [(0, 4), (4, 0), (4, 3)])
def test_invalid_sizes(num_pages: int, page_size: int) -> None:
    with pytest.raises(ValueError):
        PagePool(num_pages, page_size)


def test_pages_for_rounds_up() -> None:
    assert [PagePool.pages_for(n, 4) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]
