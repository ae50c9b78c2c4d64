"""Radix prefix cache over page-aligned token runs (RadixAttention style).

The tree maps token sequences to the KV pages that hold them. Every non-root node stores a
run of token ids whose length is a positive multiple of ``page_size`` and exactly one page id
per ``page_size`` tokens. Children are keyed by the token tuple of their first page, so two
children of one node never start with the same page. Matching always compares the token ids
themselves, page by page; no hash is trusted.

Ownership protocol (pool references)
------------------------------------
Every page in the pool has a reference count (see ``PagePool``). There are exactly two kinds
of holders:

* **The cache** holds exactly ONE ref on every page stored in the tree. It takes that ref in
  ``insert`` (``pool.incref``) when it *adopts* a page, and gives it back in ``evict`` or
  ``reset`` (``pool.decref``). It never takes a ref on a page it does not store.
* **A request** holds its own ref on each page in its page table, whether the page came from
  ``pool.allocate`` (ref 1, the request's) or from ``match_prefix`` (the request must
  ``pool.incref`` the matched pages).

The request life cycle that the scheduler follows:

1. Admission: ``m = cache.match_prefix(prompt)``; ``cache.lock(m.node)``;
   ``pool.incref(m.pages)``; the page table starts as ``m.pages``, the request skips
   prefill of the first ``m.num_tokens`` tokens and allocates pages for the rest
   (on ``OutOfPages``: ``cache.evict(shortfall)`` and retry, then preempt). To keep at least
   one token to prefill (the logits of the last prompt token are needed), match
   ``prompt[:-1]`` instead.
2. Finish (or preemption): ``n, _ = cache.insert(tokens, pages)``; then
   ``pool.decref(pages)`` for ALL the request's pages; then ``cache.unlock(m.node)``.
   ``insert`` adopts (increfs) only the pages of the page-aligned prefix that were not yet
   in the tree, i.e. ``pages[n // page_size : len(tokens) // page_size]``. The pages of the
   first ``n`` tokens are duplicates: either the very pages the request matched (they fall
   back to the cache's single ref) or pages the request computed itself while another
   request inserted the same tokens (they fall to ref 0 and are freed). A trailing partial
   page is never cached; the request's decref frees it.
3. (Optional, for chunked prefill that wants to share its progress early) insert the tokens
   computed so far, then ``m2 = match_prefix(tokens)``, ``lock(m2.node)``,
   ``pool.incref(m2.pages)``, ``pool.decref`` the request's old pages for that prefix,
   ``unlock`` the old node, and continue with ``m2.pages`` as the head of the page table.

Invariant that follows: **every request that uses cached pages locks their node**, so the
pages of an unlocked node are held by the cache alone (ref exactly 1) and evicting them
returns them to the pool; pages of a locked node have ref >= 2 (cache + a locking request).
``check_accounting`` verifies exactly this.

Locks are counted on the node and all its ancestors (the root excluded: it holds no pages and
is never evicted), so ``lock_ref(node) = direct locks on node + sum(lock_ref(child))`` and a
node is evictable iff it is a leaf with ``lock_ref == 0``. Splitting a node keeps the deeper
half as the original object, so a lock handle taken earlier stays valid; the new upper half
inherits the lock count because every lock below passes through it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from .pool import PagePool
from .radix_checks import RadixChecks

PageKey = tuple[int, ...]


@dataclass(slots=True, eq=False)  # eq=False: nodes compare and hash by identity
class Node:
    tokens: tuple[int, ...]
    pages: tuple[int, ...]
    # repr=False: the default repr would print the whole tree through parent/children.
    parent: Node | None = field(repr=False)
    id: int
    children: dict[PageKey, Node] = field(default_factory=dict, repr=False)
    lock_ref: int = 0
    last_access: int = 0

    @property
    def num_pages(self) -> int:
        return len(self.pages)


@dataclass(slots=True, frozen=True)
class MatchResult:
    """``pages`` hold ``tokens[:num_tokens]``; ``node`` is the deepest matched node (the root
    when nothing matched). Lock ``node`` to keep ``pages`` in the cache."""

    pages: list[int]
    num_tokens: int
    node: Node


class RadixCache(RadixChecks):
    def __init__(self, pool: PagePool, page_size: int) -> None:
        if page_size != pool.page_size:
            raise ValueError(f"page_size {page_size} != pool.page_size {pool.page_size}")
        self.pool = pool
        self.page_size = page_size
        self._ids = itertools.count()
        self._clock = 0  # logical time: bumped once per match/insert, never wall time
        self._init_tree()

    def _init_tree(self) -> None:
        self.root = Node(tokens=(), pages=(), parent=None, id=next(self._ids))
        self._num_cached = 0  # pages stored in the tree
        self._num_protected = 0  # pages stored in nodes with lock_ref > 0
        # The evictable nodes (unlocked leaves), kept as they change: with a full pool every
        # step evicts a few pages, and walking the whole tree for them cost milliseconds.
        self._leaves: set[Node] = set()

    # ------------------------------------------------------------------ queries

    def cached_pages(self) -> int:
        """Pages stored in the tree (each carries exactly one cache-owned pool ref)."""
        return self._num_cached

    def evictable_pages(self) -> int:
        """Pages in unlocked nodes: what ``evict`` can free (given the protocol)."""
        return self._num_cached - self._num_protected

    def match_prefix(self, tokens: Sequence[int], under: Node | None = None) -> MatchResult:
        """Longest cached prefix of ``tokens`` in whole pages.

        Splits a node when the match ends inside it (at a page boundary), so the returned
        node covers exactly the matched tokens; refreshes last_access along the path.
        ``under``: start from that node instead of the root (``tokens`` then continue its
        path, and ``pages``/``num_tokens`` count from it).
        """
        ps = self.page_size
        n_pages = len(tokens) // ps
        key_tokens = tuple(tokens[: n_pages * ps])
        node, i, pages = self._walk(key_tokens, n_pages, under)
        return MatchResult(pages=pages, num_tokens=i * ps, node=node)

    def partial_page(self, node: Node, tokens: Sequence[int]) -> tuple[int, int]:
        """The cached page right below ``node`` whose first tokens best match ``tokens`` (fewer
        than a page): returns ``(page id, matched tokens)``, ``(-1, 0)`` when none matches.

        The page holds the KV of those leading tokens at the same positions, so a request can
        copy them into a page of its own instead of computing them (copy on write: the cached
        page itself is never handed out partially)."""
        ps = self.page_size
        want = tuple(tokens[:ps])
        best, best_n = -1, 0
        for key, child in node.children.items():
            n = 0
            for a, b in zip(key, want):
                if a != b:
                    break
                n += 1
            if n > best_n:
                best, best_n = child.pages[0], n
        return best, min(best_n, ps - 1)

    def _walk(
        self, key_tokens: tuple[int, ...], n_pages: int, start: Node | None = None
    ) -> tuple[Node, int, list[int]]:
        """Follow the tree along key_tokens from ``start`` (default: the root), splitting the
        last node at the point of divergence. Returns (deepest node reached, pages matched,
        their page ids); refreshes last_access."""
        ps = self.page_size
        self._clock += 1
        node = self.root if start is None else start
        assert node is self.root or node.parent is not None, "walk from a node no longer in the tree"
        pages: list[int] = []
        i = 0  # pages matched so far
        while i < n_pages:
            child = node.children.get(key_tokens[i * ps : (i + 1) * ps])
            if child is None:
                break
            m = self._common_pages(child, key_tokens, i, n_pages)
            if m < child.num_pages:
                child = self._split(child, m)
            child.last_access = self._clock
            pages.extend(child.pages)
            node = child
            i += m
        return node, i, pages

    # ------------------------------------------------------------------ locking

    def lock(self, node: Node) -> None:
        """Protect ``node`` and its ancestors from eviction (counted; pair with unlock)."""
        while node is not self.root:
            assert node.parent is not None, "lock of a node that is no longer in the tree"
            if node.lock_ref == 0:
                self._num_protected += node.num_pages
                self._leaves.discard(node)
            node.lock_ref += 1
            node = node.parent

    def move_lock(self, old: Node, new: Node) -> None:
        """``unlock(old); lock(new)`` for ``new`` at or below ``old``, touching only the
        nodes between them: the counts of ``old`` and its ancestors do not change (the lock
        still passes through them). A request that extends its cached prefix page by page
        would otherwise walk its whole path twice per page."""
        node = new
        while node is not old:
            assert node is not self.root and node.parent is not None, "new is not below old"
            if node.lock_ref == 0:
                self._num_protected += node.num_pages
                self._leaves.discard(node)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            assert node.parent is not None, "unlock of a node that is no longer in the tree"
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock of unlocked node {node.id}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._num_protected -= node.num_pages
                if not node.children:
                    self._leaves.add(node)
            node = node.parent

    # ------------------------------------------------------------------ insert

    def insert(self, tokens: Sequence[int], pages: Sequence[int], under: Node | None = None) -> tuple[int, Node]:
        """Cache the page-aligned prefix of ``tokens`` (``len(tokens) // page_size`` pages).

        ``pages[j]`` holds ``tokens[j*ps:(j+1)*ps]``; extra pages (a partial tail) are
        ignored. Returns ``(n, node)``: ``n`` tokens were already cached (their pages in
        ``pages`` are duplicates the cache does NOT take), the cache adopted (incref'd)
        ``pages[n//ps : len(tokens)//ps]``, and ``node`` covers exactly the inserted prefix.
        The caller keeps its own refs on all of ``pages`` and releases them itself.
        ``under``: ``tokens`` continue the path of that node (see ``match_prefix``).
        """
        ps = self.page_size
        n_pages = len(tokens) // ps
        if len(pages) < n_pages:
            raise ValueError(f"{len(tokens)} tokens need {n_pages} pages, got {len(pages)}")
        key_tokens = tuple(tokens[: n_pages * ps])
        node, i, _ = self._walk(key_tokens, n_pages, under)
        if i < n_pages:
            new_pages = tuple(pages[i:n_pages])
            # The caller must hold these pages: incref asserts they are not free.
            self.pool.incref(list(new_pages))
            new = Node(
                tokens=key_tokens[i * ps :],
                pages=new_pages,
                parent=node,
                id=next(self._ids),
                last_access=self._clock,
            )
            node.children[new.tokens[:ps]] = new
            self._leaves.discard(node)
            self._leaves.add(new)
            self._num_cached += len(new_pages)
            # A new child of a locked node is itself unlocked: nothing to protect.
            node = new
        return i * ps, node

    # ------------------------------------------------------------------ eviction

    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` pages from unlocked leaves, least recently used first.

        A leaf is trimmed from its tail when only part of it is needed, so exactly the
        requested amount is released when enough is evictable. Returns the number of pages
        that went back to the pool (a page some holder still refs would not count, though
        the protocol rules that out for unlocked nodes).
        """
        if num_pages <= 0:
            return 0
        heap = [(n.last_access, n.id, n) for n in self._leaves]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            take = min(num_pages - freed, leaf.num_pages)
            victims = list(leaf.pages[leaf.num_pages - take :])
            parent = leaf.parent
            assert parent is not None
            if take < leaf.num_pages:
                keep = leaf.num_pages - take
                leaf.pages = leaf.pages[:keep]
                leaf.tokens = leaf.tokens[: keep * self.page_size]
            else:
                del parent.children[leaf.tokens[: self.page_size]]
                leaf.parent = None
                self._leaves.discard(leaf)
                if self._evictable(parent):
                    self._leaves.add(parent)
                    heapq.heappush(heap, (parent.last_access, parent.id, parent))
            self._num_cached -= take
            freed += sum(1 for p in victims if self.pool.ref_count(p) == 1)
            self.pool.decref(victims)
        return freed

    def reset(self) -> None:
        """Drop the whole tree, releasing the cache's ref on every page. No node may be
        locked (a running request would lose the pages it reads)."""
        for node in self._nodes():
            if node.lock_ref:
                raise RuntimeError(f"reset with locked node {node.id}")
        for node in self._nodes():
            self.pool.decref(list(node.pages))
        self._init_tree()

    def forget(self) -> None:
        """Drop the whole tree without touching the pool (which the caller resets too)."""
        self._init_tree()

    # ------------------------------------------------------------------ helpers

    def _nodes(self) -> Iterator[Node]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _evictable(self, node: Node) -> bool:
        return node is not self.root and node.lock_ref == 0 and not node.children

    def _common_pages(self, node: Node, key_tokens: PageKey, start: int, n_pages: int) -> int:
        """Leading whole pages of ``node`` equal to ``key_tokens`` from page ``start``."""
        ps = self.page_size
        m = 0
        limit = min(node.num_pages, n_pages - start)
        while m < limit:
            a = (start + m) * ps
            if node.tokens[m * ps : (m + 1) * ps] != key_tokens[a : a + ps]:
                break
            m += 1
        return m

    def _split(self, node: Node, m: int) -> Node:
        """Split ``node`` after its first ``m`` pages (0 < m < num_pages); returns the new
        upper node. ``node`` keeps the lower part so existing lock handles stay valid."""
        assert 0 < m < node.num_pages
        ps = self.page_size
        parent = node.parent
        assert parent is not None
        upper = Node(
            tokens=node.tokens[: m * ps],
            pages=node.pages[:m],
            parent=parent,
            id=next(self._ids),
            # Every lock on node passes through upper; its pages keep their protected state.
            lock_ref=node.lock_ref,
            last_access=node.last_access,
        )
        node.tokens = node.tokens[m * ps :]
        node.pages = node.pages[m:]
        node.parent = upper
        upper.children[node.tokens[:ps]] = node
        parent.children[upper.tokens[:ps]] = upper  # same key: first page unchanged
        return upper
