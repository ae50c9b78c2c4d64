"""Unit tests of RadixCache; the randomized workload lives in test_radix_workload.py."""

from __future__ import annotations

import pytest

from constrained_serve.cache.pool import PagePool
from constrained_serve.cache.radix import Node, RadixCache

PS = 2  # page size used by most tests


def make(num_pages: int = 16, page_size: int = PS) -> tuple[PagePool, RadixCache]:
    pool = PagePool(num_pages, page_size)
    return pool, RadixCache(pool, page_size)


def finish(pool: PagePool, cache: RadixCache, tokens: list[int]) -> list[int]:
    """A request that computed ``tokens`` on fresh pages and finished: insert + decref."""
    pages = pool.allocate(PagePool.pages_for(len(tokens), pool.page_size))
    cache.insert(tokens, pages)
    pool.decref(pages)
    check(pool, cache)
    return pages


def check(pool: PagePool, cache: RadixCache, in_use: int = 0) -> None:
    pool.check_integrity()
    cache.check_integrity()
    cache.check_accounting(in_use)


def path(node: Node) -> list[Node]:
    out = []
    while node.parent is not None:
        out.append(node)
        node = node.parent
    return out[::-1]


def test_page_size_must_match_pool() -> None:
    with pytest.raises(ValueError):
        RadixCache(PagePool(4, 2), 4)


def test_empty_cache_matches_nothing() -> None:
    pool, cache = make()
    m = cache.match_prefix([1, 2, 3, 4])
    assert (m.pages, m.num_tokens, m.node) == ([], 0, cache.root)
    check(pool, cache)


def test_insert_then_match_whole_pages_only() -> None:
    pool, cache = make()
    pages = pool.allocate(3)  # 5 tokens: 2 full pages + a partial one
    n, node = cache.insert([1, 2, 3, 4, 5], pages)
    assert n == 0 and node.tokens == (1, 2, 3, 4) and node.pages == tuple(pages[:2])
    # The cache took one ref on the 2 full pages only.
    assert [pool.ref_count(p) for p in pages] == [2, 2, 1]
    pool.decref(pages)
    assert pool.ref_count(pages[2]) == 0, "the partial page is not cached"
    check(pool, cache)

    m = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert m.pages == pages[:2] and m.num_tokens == 4 and m.node is node
    # A query shorter than a page, or diverging inside the first page, matches nothing.
    assert cache.match_prefix([1]).num_tokens == 0
    assert cache.match_prefix([1, 9, 3, 4]).num_tokens == 0


def test_partial_page_finds_the_best_leading_match_below_a_node() -> None:
    pool, cache = make(page_size=4)
    a = finish(pool, cache, [1, 2, 3, 4, 5, 6, 7, 8])
    b = finish(pool, cache, [1, 2, 3, 4, 5, 9, 9, 9])
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 0])
    assert m.num_tokens == 4
    assert cache.partial_page(m.node, [5, 6, 0]) == (a[1], 2)  # (5, 6) beats b's (5,)
    assert cache.partial_page(m.node, [5, 9]) == (b[1], 2)
    assert cache.partial_page(m.node, [7]) == (-1, 0)
    assert cache.partial_page(cache.root, [1, 2, 3]) == (a[0], 3)  # never a whole page
    check(pool, cache)


def test_match_ending_inside_a_node_splits_it_at_a_page_boundary() -> None:
    pool, cache = make()
    pages = finish(pool, cache, [1, 2, 3, 4, 5, 6, 7, 8])
    (leaf,) = cache.root.children.values()
    # Diverges inside the third page: two whole pages match.
    m = cache.match_prefix([1, 2, 3, 4, 5, 9])
    assert m.num_tokens == 4 and m.pages == pages[:2]
    upper = m.node
    assert upper.tokens == (1, 2, 3, 4) and upper.pages == tuple(pages[:2])
    assert cache.root.children[(1, 2)] is upper
    # The original node object keeps the lower half, so older handles to it stay valid.
    assert upper.children == {(5, 6): leaf}
    assert leaf.parent is upper and leaf.tokens == (5, 6, 7, 8)
    assert cache.cached_pages() == 4
    check(pool, cache)
    # The full sequence still matches through both halves.
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).pages == pages


def test_token_ids_are_compared_not_hashes() -> None:
    # hash(-1) == hash(-2) in CPython, so these page keys collide; the lookup must still
    # tell them apart by comparing the ids.
    assert hash((-1,)) == hash((-2,))
    pool, cache = make(page_size=1)
    finish(pool, cache, [7, -1, 5])
    assert cache.match_prefix([7, -2, 5]).num_tokens == 1
    assert cache.match_prefix([7, -1, 5]).num_tokens == 3
    # Same first page, a later page differs by one token: matching stops there.
    pool, cache = make()
    finish(pool, cache, [1, 2, 3, 4, 5, 6])
    assert cache.match_prefix([1, 2, 3, 4, 5, 7]).num_tokens == 4
    assert cache.match_prefix([1, 2, 0, 4, 5, 6]).num_tokens == 2


def test_insert_of_cached_tokens_adopts_no_duplicate_pages() -> None:
    pool, cache = make()
    first = finish(pool, cache, [1, 2, 3, 4])
    # Another request computed the same tokens on its own pages meanwhile.
    dup = pool.allocate(2)
    n, node = cache.insert([1, 2, 3, 4], dup)
    assert n == 4 and node.pages == tuple(first)
    assert [pool.ref_count(p) for p in dup] == [1, 1], "duplicates are not adopted"
    check(pool, cache, in_use=2)
    pool.decref(dup)  # the caller's release frees them
    assert pool.num_free == 16 - 2
    check(pool, cache)


def test_insert_extending_a_cached_prefix_adopts_only_the_suffix() -> None:
    pool, cache = make()
    first = finish(pool, cache, [1, 2, 3, 4])
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    cache.lock(m.node)
    pool.incref(m.pages)
    own = pool.allocate(2)
    pages = m.pages + own
    check(pool, cache, in_use=4)
    n, node = cache.insert([1, 2, 3, 4, 5, 6, 7, 8], pages)
    assert n == 4 and node.tokens == (5, 6, 7, 8) and node.pages == tuple(own)
    assert node.parent is m.node
    pool.decref(pages)
    cache.unlock(m.node)
    assert [pool.ref_count(p) for p in first + own] == [1, 1, 1, 1]
    check(pool, cache)


def test_insert_diverging_inside_a_node_splits_and_branches() -> None:
    pool, cache = make()
    a = finish(pool, cache, [1, 2, 3, 4, 5, 6])
    b = finish(pool, cache, [1, 2, 3, 4, 9, 9])
    (upper,) = cache.root.children.values()
    assert upper.tokens == (1, 2, 3, 4) and set(upper.children) == {(5, 6), (9, 9)}
    assert upper.children[(9, 9)].pages == (b[2],)
    assert pool.ref_count(b[0]) == 0 and pool.ref_count(b[1]) == 0, "duplicates freed"
    assert cache.match_prefix([1, 2, 3, 4, 9, 9]).pages == a[:2] + [b[2]]


def test_insert_of_a_shorter_prefix_returns_the_exact_node() -> None:
    pool, cache = make()
    finish(pool, cache, [1, 2, 3, 4, 5, 6])
    dup = pool.allocate(1)
    n, node = cache.insert([1, 2, 3], dup)
    assert n == 2 and node.tokens == (1, 2) and len(path(node)) == 1
    pool.decref(dup)
    check(pool, cache)


def test_insert_needs_a_page_per_full_page_of_tokens() -> None:
    pool, cache = make()
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3, 4], pool.allocate(1))


def test_lock_counts_on_node_and_all_ancestors() -> None:
    pool, cache = make()
    finish(pool, cache, [1, 2, 3, 4, 5, 6])
    finish(pool, cache, [1, 2, 3, 4, 7, 8])
    deep = cache.match_prefix([1, 2, 3, 4, 5, 6]).node
    upper, _ = path(deep)
    sibling = upper.children[(7, 8)]
    assert cache.evictable_pages() == 4
    cache.lock(deep)
    cache.lock(deep)
    cache.lock(sibling)
    assert (upper.lock_ref, deep.lock_ref, sibling.lock_ref) == (3, 2, 1)
    assert cache.root.lock_ref == 0
    assert cache.evictable_pages() == 0
    cache.unlock(sibling)
    assert (upper.lock_ref, sibling.lock_ref) == (2, 0)
    assert cache.evictable_pages() == 1
    cache.check_integrity()
    cache.unlock(deep)
    cache.unlock(deep)
    assert upper.lock_ref == 0 and cache.evictable_pages() == 4
    with pytest.raises(RuntimeError):
        cache.unlock(deep)
    cache.check_integrity()


def test_split_of_a_locked_node_keeps_the_lock_valid() -> None:
    pool, cache = make()
    finish(pool, cache, [1, 2, 3, 4, 5, 6])
    m = cache.match_prefix([1, 2, 3, 4, 5, 6])
    cache.lock(m.node)
    pool.incref(m.pages)
    # A second request matches part of the locked node: it is split under the lock.
    m2 = cache.match_prefix([1, 2, 3, 4, 0, 0])
    assert m2.node is m.node.parent and m2.node.lock_ref == 1
    check(pool, cache, in_use=3)
    assert cache.evict(3) == 0
    pool.decref(m.pages)
    cache.unlock(m.node)
    assert m2.node.lock_ref == 0
    check(pool, cache)
    assert cache.evict(3) == 3


def test_eviction_is_lru_over_leaves() -> None:
    pool, cache = make()
    a = finish(pool, cache, [1, 1, 1, 1])
    b = finish(pool, cache, [2, 2, 2, 2])
    c = finish(pool, cache, [3, 3, 3, 3])
    cache.match_prefix([1, 1, 1, 1])  # touches a: now b is the least recently used
    assert cache.evict(2) == 2
    assert all(pool.ref_count(p) == 0 for p in b)
    assert cache.match_prefix([2, 2]).num_tokens == 0
    check(pool, cache)
    # Next oldest is c (inserted before a was touched).
    assert cache.evict(2) == 2
    assert all(pool.ref_count(p) == 0 for p in c)
    assert cache.match_prefix([1, 1, 1, 1]).pages == a


def test_untouched_tail_of_a_split_node_keeps_its_old_time() -> None:
    # LRU is per page run: a match that uses only the head of a node does not refresh
    # the unused tail, which becomes the least recently used leaf.
    pool, cache = make()
    a = finish(pool, cache, [1, 1, 1, 1])
    b = finish(pool, cache, [2, 2])
    cache.match_prefix([1, 1, 0, 0])
    assert cache.evict(1) == 1
    assert pool.ref_count(a[1]) == 0 and pool.ref_count(b[0]) == 1
    assert cache.evict(1) == 1
    assert pool.ref_count(b[0]) == 0 and pool.ref_count(a[0]) == 1
    check(pool, cache)


def test_eviction_trims_a_leaf_from_its_tail() -> None:
    pool, cache = make()
    pages = finish(pool, cache, [1, 2, 3, 4, 5, 6])
    assert cache.evict(1) == 1
    assert pool.ref_count(pages[2]) == 0
    m = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert m.pages == pages[:2] and m.num_tokens == 4
    check(pool, cache)


def test_parent_becomes_evictable_in_the_same_call() -> None:
    pool, cache = make()
    finish(pool, cache, [1, 2, 3, 4])
    finish(pool, cache, [1, 2, 3, 4, 5, 6])
    finish(pool, cache, [1, 2, 3, 4, 7, 8])
    assert cache.cached_pages() == 4
    assert cache.evict(100) == 4
    assert cache.cached_pages() == 0 and cache.root.children == {}
    assert pool.num_free == pool.num_pages
    check(pool, cache)


def test_locked_nodes_are_never_evicted() -> None:
    pool, cache = make()
    finish(pool, cache, [1, 2, 3, 4, 5, 6])
    finish(pool, cache, [9, 9, 9, 9])
    m = cache.match_prefix([1, 2, 3, 4])
    cache.lock(m.node)
    pool.incref(m.pages)
    check(pool, cache, in_use=2)
    # Only [5, 6] (below the locked node) and [9, 9, 9, 9] can go.
    assert cache.evict(100) == 3
    assert cache.match_prefix([1, 2, 3, 4]).pages == m.pages
    assert cache.evictable_pages() == 0 and cache.cached_pages() == 2
    check(pool, cache, in_use=2)
    pool.decref(m.pages)
    cache.unlock(m.node)
    assert cache.evict(100) == 2
    assert pool.num_free == pool.num_pages


def test_evict_counts_only_pages_returned_to_the_pool() -> None:
    # A protocol violation (a request holding cached pages without a lock) is caught by
    # check_accounting, and evict does not report such pages as freed.
    pool, cache = make()
    finish(pool, cache, [1, 2, 3, 4])
    m = cache.match_prefix([1, 2, 3, 4])
    pool.incref(m.pages)  # no lock
    with pytest.raises(AssertionError):
        cache.check_accounting(in_use_by_requests=2)
    assert cache.evict(2) == 0
    assert cache.cached_pages() == 0
    pool.decref(m.pages)
    assert pool.num_free == pool.num_pages


def test_accounting_detects_a_leaked_page() -> None:
    pool, cache = make()
    finish(pool, cache, [1, 2, 3, 4])
    cache.check_accounting(0)
    pool.allocate(1)  # held by nobody the caller reports
    with pytest.raises(AssertionError):
        cache.check_accounting(0)
    cache.check_accounting(1)


def test_reset_releases_every_page_and_refuses_while_locked() -> None:
    pool, cache = make()
    finish(pool, cache, [1, 2, 3, 4, 5, 6])
    finish(pool, cache, [1, 2, 7, 8])
    m = cache.match_prefix([1, 2])
    cache.lock(m.node)
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.unlock(m.node)
    cache.reset()
    assert cache.cached_pages() == 0 and pool.num_free == pool.num_pages
    check(pool, cache)
    assert cache.match_prefix([1, 2]).num_tokens == 0


def test_last_access_is_a_logical_clock() -> None:
    pool, cache = make()
    finish(pool, cache, [1, 2])
    finish(pool, cache, [3, 4])
    a = cache.root.children[(1, 2)]
    b = cache.root.children[(3, 4)]
    assert a.last_access < b.last_access
    cache.match_prefix([1, 2])
    assert a.last_access > b.last_access
