"""The radix cache's self-checks (tests run them after every step of random workloads): the
tree's structure and counters, and the pool-level partition of pages that the ownership
protocol in radix.py implies. ``RadixChecks`` is a part of ``RadixCache``."""

from __future__ import annotations


class RadixChecks:
    def check_integrity(self) -> None:
        """Assert the tree's structure and the counters kept alongside it."""
        ps = self.page_size
        root = self.root
        assert root.parent is None and not root.tokens and not root.pages
        assert root.lock_ref == 0, "the root is never locked"
        seen: set[int] = set()
        cached = protected = 0
        for node in self._nodes():
            if node is not root:
                assert node.num_pages >= 1, f"node {node.id} is empty"
                assert len(node.tokens) == node.num_pages * ps, f"node {node.id}: size"
                assert node.parent is not None
                assert node.parent.children.get(node.tokens[:ps]) is node
                assert node.lock_ref >= 0
                if node.lock_ref > 0:
                    protected += node.num_pages
                    assert node.parent is root or node.parent.lock_ref > 0, (
                        f"node {node.id} locked but its parent is not"
                    )
                assert node.last_access <= self._clock
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()) or (node is root), (
                f"node {node.id}: lock_ref below its children's"
            )
            for key, child in node.children.items():
                assert len(key) == ps and child.tokens[:ps] == key, f"bad key on {child.id}"
                assert child.parent is node
            for p in node.pages:
                assert p not in seen, f"page {p} cached twice"
                seen.add(p)
                assert self.pool.ref_count(p) >= 1, f"cached page {p} is free in the pool"
            cached += node.num_pages
        assert cached == self._num_cached, f"cached count {self._num_cached} != {cached}"
        assert protected == self._num_protected, f"protected count {self._num_protected} != {protected}"
        leaves = {n for n in self._nodes() if self._evictable(n)}
        assert leaves == self._leaves, (
            f"evictable leaves kept {sorted(n.id for n in self._leaves)} != {sorted(n.id for n in leaves)}"
        )

    def check_accounting(self, in_use_by_requests: int) -> None:
        """Assert the pool-level partition of pages, given the protocol above.

        ``in_use_by_requests`` is the number of DISTINCT pages on which at least one request
        holds a ref (the union of all running requests' page tables). Every page is then in
        exactly one of three sets:

        * free (pool ref 0),
        * held only by the cache: the pages of unlocked nodes, each with ref exactly 1,
        * held by requests: private pages, plus the pages of locked nodes (ref >= 2).

        so ``pool.num_free + evictable_pages() + in_use_by_requests == pool.num_pages``.
        """
        for node in self._nodes():
            for p in node.pages:
                r = self.pool.ref_count(p)
                if node.lock_ref == 0:
                    assert r == 1, f"page {p} of unlocked node {node.id} has ref {r} != 1"
                else:
                    assert r >= 2, f"page {p} of locked node {node.id} has ref {r} < 2"
        total = self.pool.num_free + self.evictable_pages() + in_use_by_requests
        assert total == self.pool.num_pages, (
            f"free {self.pool.num_free} + cache-only {self.evictable_pages()} + "
            f"in use {in_use_by_requests} = {total} != {self.pool.num_pages}"
        )
