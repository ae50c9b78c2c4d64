"""KVCacheManager.share_progress: publishing pages to the prefix cache while requests run.

A randomized workload of requests with colliding prefixes (a tiny vocabulary) decodes token
by token, publishing each completed page, while others finish, get evicted from or match
the cache. A shadow of each page's content (the token ids written into it) proves that a
request's page table always holds its own tokens, whichever copy of a page it ends up with.
"""

from __future__ import annotations

import random

import pytest

from constrained_serve.cache.manager import KVCacheManager
from constrained_serve.cache.pool import PagePool
from constrained_serve.cache.radix import RadixCache
from constrained_serve.engine.request import Request
from constrained_serve.params import SamplingParams

PS = 4


def _manager(num_pages: int = 400) -> KVCacheManager:
    pool = PagePool(num_pages, PS)
    return KVCacheManager(pool, RadixCache(pool, PS))


def _request(prompt: list[int]) -> Request:
    r = Request(prompt_ids=list(prompt), params=SamplingParams(max_tokens=1000))
    r.token_ids = list(prompt)
    return r


def _check_content(kv: KVCacheManager, running: list[Request], content: dict[int, tuple]) -> None:
    kv.check_integrity(running)
    for r in running:
        for j in range(r.num_computed // PS):
            assert content[r.pages[j]] == tuple(r.token_ids[j * PS : (j + 1) * PS]), (
                f"request {r.request_id} page {j} holds other tokens"
            )


@pytest.mark.parametrize("seed", range(6))
def test_share_progress_randomized(seed: int) -> None:
    rng = random.Random(seed)
    kv = _manager()
    content: dict[int, tuple] = {}  # page id -> the tokens whose KV it holds
    running: list[Request] = []
    for _ in range(400):
        if len(running) < 4 and rng.random() < 0.3:
            r = _request([rng.randrange(2) for _ in range(rng.randrange(2, 14))])
            kv.match_prefix(r)
            running.append(r)
        for r in list(running):
            if not kv.ensure_pages(r, r.num_computed + 1):
                kv.release(r, cache_tokens=True)
                running.remove(r)
                continue
            pos = r.num_computed
            if pos >= len(r.token_ids):
                r.token_ids.append(rng.randrange(2))
            r.num_computed += 1
            page = r.pages[pos // PS]
            if pos % PS == 0:
                content[page] = ()
            # A page is written once, by the request that computed it (shared pages are
            # full and never written again).
            content[page] = content[page] + (r.token_ids[pos],)
            if r.num_computed % PS == 0:
                kv.share_progress(r)
            if rng.random() < 0.03 or r.num_computed > 60:
                kv.release(r, cache_tokens=True)
                running.remove(r)
        if rng.random() < 0.05:
            kv.radix.evict(rng.randrange(1, 8))
        _check_content(kv, running, content)
    for r in running:
        kv.release(r, cache_tokens=True)
    kv.check_integrity([])


def test_share_progress_walks_only_the_new_page(monkeypatch) -> None:
    """Publishing page k must not re-walk the k-1 pages before it (a long decode was
    quadratic): the number of pages compared per call stays flat as the output grows."""
    kv = _manager(num_pages=600)
    r = _request(list(range(10)))
    kv.match_prefix(r)
    compared = []
    common = RadixCache._common_pages

    def counting(self, node, key_tokens, start, n_pages):
        m = common(self, node, key_tokens, start, n_pages)
        compared[-1] += m
        return m

    monkeypatch.setattr(RadixCache, "_common_pages", counting)
    while r.num_computed < 2000:
        kv.ensure_pages(r, r.num_computed + 1)
        r.num_computed += 1
        if r.num_computed >= len(r.token_ids):
            r.token_ids.append(r.num_computed % 7)
        if r.num_computed % PS == 0:
            compared.append(0)
            kv.share_progress(r)
    assert r.num_shared == 2000
    assert max(compared) <= 2, f"pages compared per publish grew to {max(compared)}"
    kv.check_integrity([r])
    assert kv.radix.match_prefix(r.token_ids[:2000]).pages == r.pages[:500]
    kv.release(r, cache_tokens=True)
    kv.check_integrity([])
