"""Randomized scheduler-like workload over PagePool + RadixCache.

Requests share random prefixes (a few "system prompts" and multi-turn continuations of
finished requests), are admitted with match + lock + incref, decode token by token,
and finish with insert + decref + unlock (or are preempted: decref + unlock). Allocation
failures evict from the cache. After every operation the pool, the tree and the accounting
are checked, and a shadow copy of each page's "KV content" (the token ids written into it)
proves that the cache only ever hands out pages holding exactly the matched tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from constrained_serve.cache.pool import OutOfPages, PagePool
from constrained_serve.cache.radix import Node, RadixCache


@dataclass(slots=True)
class Req:
    tokens: list[int]
    pages: list[int]
    lock_node: Node
    num_matched: int
    max_len: int


class Sim:
    def __init__(self, seed: int, num_pages: int, page_size: int, vocab: int = 3) -> None:
        self.rng = random.Random(seed)
        self.ps = page_size
        self.vocab = vocab  # tiny vocab: accidental matches that diverge mid-page abound
        self.pool = PagePool(num_pages, page_size)
        self.cache = RadixCache(self.pool, page_size)
        self.running: list[Req] = []
        self.histories: list[list[int]] = []
        self.content: dict[int, list[int]] = {}  # page -> token ids its KV holds
        self.prefixes = [self.rand_tokens(self.rng.randint(0, 5 * page_size)) for _ in range(4)]
        self.stats = {"hit_tokens": 0, "evicted": 0, "rejected": 0, "preempted": 0}

    def rand_tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    # --------------------------------------------------------------- checks

    def check(self) -> None:
        self.pool.check_integrity()
        self.cache.check_integrity()
        held = {p for r in self.running for p in r.pages}
        self.cache.check_accounting(len(held))
        # Pages no one holds lose their content, so a stale page handed out would show.
        for p in list(self.content):
            if self.pool.ref_count(p) == 0:
                del self.content[p]
        # Every cached page holds the tokens its node says.
        stack = [self.cache.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            for j, p in enumerate(node.pages):
                assert self.content[p] == list(node.tokens[j * self.ps : (j + 1) * self.ps])
        # Every request's pages hold its tokens.
        for r in self.running:
            assert len(r.pages) == PagePool.pages_for(len(r.tokens), self.ps)
            for j, p in enumerate(r.pages):
                assert self.content[p] == r.tokens[j * self.ps : (j + 1) * self.ps]

    # --------------------------------------------------------------- scheduler moves

    def allocate(self, n: int) -> list[int] | None:
        short = n - self.pool.num_free
        if short > 0:
            evictable = self.cache.evictable_pages()
            freed = self.cache.evict(short)
            # The protocol makes eviction exact: unlocked pages have ref 1.
            assert freed == min(short, evictable)
            self.stats["evicted"] += freed
        try:
            return self.pool.allocate(n)
        except OutOfPages:
            return None

    def admit(self) -> None:
        roll = self.rng.random()
        if roll < 0.4 and self.histories:  # multi-turn: the exact history plus a new turn
            head = self.rng.choice(self.histories)
        elif roll < 0.9:
            p = self.rng.choice(self.prefixes)
            head = p[: self.rng.randint(0, len(p))]
        else:
            head = []
        prompt = head + self.rand_tokens(self.rng.randint(1, 3 * self.ps))
        if PagePool.pages_for(len(prompt), self.ps) > self.pool.num_pages // 2:
            return
        m = self.cache.match_prefix(prompt)
        assert m.num_tokens == len(m.pages) * self.ps <= len(prompt)
        for j, p in enumerate(m.pages):
            assert self.content[p] == prompt[j * self.ps : (j + 1) * self.ps]
        self.cache.lock(m.node)
        self.pool.incref(m.pages)
        new = self.allocate(PagePool.pages_for(len(prompt), self.ps) - len(m.pages))
        if new is None:
            self.pool.decref(m.pages)
            self.cache.unlock(m.node)
            self.stats["rejected"] += 1
            return
        for j, p in enumerate(new, start=len(m.pages)):  # "prefill" writes the KV
            self.content[p] = prompt[j * self.ps : (j + 1) * self.ps]
        self.stats["hit_tokens"] += m.num_tokens
        max_len = len(prompt) + self.rng.randint(0, 3 * self.ps)
        self.running.append(Req(prompt, m.pages + new, m.node, m.num_tokens, max_len))

    def decode(self, r: Req) -> None:
        tok = self.rng.randrange(self.vocab)
        if len(r.tokens) % self.ps == 0:
            new = self.allocate(1)
            if new is None:
                self.release(r, cache_it=False)
                self.stats["preempted"] += 1
                return
            self.content[new[0]] = []
            r.pages.append(new[0])
        # The last page is partial, hence private to this request: never cached.
        assert self.pool.ref_count(r.pages[-1]) == 1
        self.content[r.pages[-1]].append(tok)
        r.tokens.append(tok)
        if len(r.tokens) >= r.max_len:
            self.release(r, cache_it=True)

    def release(self, r: Req, cache_it: bool) -> None:
        self.running.remove(r)
        if cache_it:
            n, node = self.cache.insert(r.tokens, r.pages)
            aligned = len(r.tokens) // self.ps * self.ps
            # The locked match cannot have been evicted, so at least that much was cached.
            assert r.num_matched <= n <= aligned and n % self.ps == 0
            assert len(node.tokens) == 0 or node.tokens[-1] == r.tokens[aligned - 1]
            # Right after insert, the whole page-aligned prefix is cached.
            m = self.cache.match_prefix(r.tokens)
            assert m.num_tokens == aligned and m.node is node
            self.histories.append(list(r.tokens))
        self.pool.decref(r.pages)
        self.cache.unlock(r.lock_node)

    def step(self) -> None:
        roll = self.rng.random()
        if roll < 0.35 or not self.running:
            self.admit()
        elif roll < 0.85:
            self.decode(self.rng.choice(self.running))
        elif roll < 0.95:
            self.release(self.rng.choice(self.running), cache_it=self.rng.random() < 0.7)
        else:
            self.stats["evicted"] += self.cache.evict(self.rng.randint(1, 4))

    def run(self, num_ops: int) -> None:
        self.check()
        for _ in range(num_ops):
            self.step()
            self.check()
        while self.running:
            self.release(self.running[0], cache_it=True)
            self.check()
        cached = self.cache.cached_pages()
        assert self.cache.evictable_pages() == cached, "no request left: nothing is locked"
        assert self.cache.evict(cached) == cached
        self.check()
        assert self.cache.cached_pages() == 0
        assert self.pool.num_free == self.pool.num_pages
        assert self.cache.root.children == {}


@pytest.mark.parametrize("seed", range(12))
def test_random_workload(seed: int) -> None:
    page_size = [1, 2, 4][seed % 3]
    sim = Sim(seed, num_pages=12 + 4 * (seed % 4), page_size=page_size)
    sim.run(400)
    # The workload must actually exercise sharing and memory pressure.
    assert sim.stats["hit_tokens"] > 0
    assert sim.stats["evicted"] > 0


def test_random_workload_exercises_preemption_and_rejection() -> None:
    totals = {"rejected": 0, "preempted": 0}
    for seed in range(4):
        sim = Sim(100 + seed, num_pages=8, page_size=2)
        sim.run(300)
        for k in totals:
            totals[k] += sim.stats[k]
    assert totals["rejected"] > 0 and totals["preempted"] > 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    page_size=st.sampled_from([1, 2, 4]),
    num_pages=st.integers(4, 40),
    vocab=st.integers(2, 5),
)
def test_random_workload_hypothesis(seed: int, page_size: int, num_pages: int, vocab: int) -> None:
    Sim(seed, num_pages=num_pages, page_size=page_size, vocab=vocab).run(150)
