"""A pool of fixed-size KV pages with reference counts.

The pool only does bookkeeping on page ids; the KV tensors themselves live in the runner.
A page is *free* (ref 0, on the free list) or *held* (ref >= 1: by running requests and/or
by the radix cache). The radix cache adds its own ref to every page it stores.
"""

from __future__ import annotations


class OutOfPages(RuntimeError):
    """Not enough free pages; the scheduler evicts or preempts and tries again."""


class PagePool:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.reset()

    def reset(self) -> None:
        """Every page free, whatever held it (after a step cut short: see EngineCore)."""
        self._ref = [0] * self.num_pages
        # Pop from the end: low page ids are handed out first, which keeps tests readable.
        self._free = list(range(self.num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take n free pages, each with ref count 1. Raises OutOfPages (taking nothing)."""
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._ref[p] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            assert self._ref[p] > 0, f"incref of free page {p}"
            self._ref[p] += 1

    def decref(self, pages: list[int]) -> None:
        """Drop one reference from each page; pages reaching zero go back to the free list."""
        for p in pages:
            assert self._ref[p] > 0, f"decref of free page {p}"
            self._ref[p] -= 1
            if self._ref[p] == 0:
                self._free.append(p)

    def ref_count(self, page: int) -> int:
        return self._ref[page]

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        for p, r in enumerate(self._ref):
            assert r >= 0
            assert (r == 0) == (p in free), f"page {p}: ref {r} but free={p in free}"

    @staticmethod
    def pages_for(num_tokens: int, page_size: int) -> int:
        return -(-num_tokens // page_size)
