"""Pages for requests: the page pool plus (optionally) the radix prefix cache.

Ownership: a request holds one pool reference on each page in ``request.pages``. With the
prefix cache on, pages matched at admission are shared with the cache (the request increfs
them and locks the matched node so they cannot be evicted while it runs); at release the
request's computed, page-aligned tokens are inserted into the cache (which takes its own
reference on pages it adopts), the node is unlocked, and the request drops its references.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..engine.request import Request
from .pool import OutOfPages, PagePool

if TYPE_CHECKING:
    from .pins import PinRegistry
    from .radix import RadixCache

logger = logging.getLogger(__name__)


class KVCacheManager:
    def __init__(
        self,
        pool: PagePool,
        radix: RadixCache | None = None,
        pins: PinRegistry | None = None,
        copy_page_prefix: Callable[[int, int, int], None] | None = None,
    ) -> None:
        self.pool = pool
        # Open conversations' locks on their cached history (pins.py). The scheduler has them
        # released only as a last resort: when a request could not run at all otherwise (it
        # runs alone, or nothing runs and it waits first in line). A conversation whose
        # history is then evicted recomputes it on its next turn.
        self.pins = pins
        self.page_size = pool.page_size
        self.radix = radix  # RadixCache or None (prefix caching off)
        # copy_page_prefix(src, dst, n): copy the KV of the first n slots of page src into page
        # dst in every layer (the runner's). None: prefixes are reused in whole pages only.
        self.copy_page_prefix = copy_page_prefix

    def match_prefix(self, r: Request) -> None:
        """At admission: reuse the longest cached prefix (keeping >= 1 token to compute).

        Whole pages are shared. Where the shared prefix ends inside a cached page (a common
        instruction rarely ends on a page boundary), the matching leading slots of that page
        are copied into a fresh page of r's own: on the structured benchmark that saves
        computing about 8 tokens per request."""
        if self.radix is None or r.pages or r.prompt_logprobs is not None:
            return  # (prompt logprobs need the logits of every prompt position: computed here)
        limit = r.num_tokens - 1
        m = self.radix.match_prefix(r.token_ids[:limit])
        n = m.num_tokens
        if n:
            self.radix.lock(m.node)
            self.pool.incref(m.pages)
            r.cache_node = m.node
            r.pages = list(m.pages)
            r.pages_version += 1
            r.num_shared = n
        if self.copy_page_prefix is not None and limit - n > 0:
            src, k = self.radix.partial_page(m.node, r.token_ids[n:limit])
            page = self._allocate(1) if k else None
            if page:
                [dst] = page
                self.copy_page_prefix(src, dst, k)
                r.pages.append(dst)
                n += k
        r.num_computed = n
        if n and r.num_preemptions == 0 and r.num_cached == 0:
            r.num_cached = min(n, r.num_prompt)

    def _allocate(self, n: int) -> list[int] | None:
        """n fresh pages, evicting cached ones if needed; None when even that is not enough."""
        if self.pool.num_free < n and self.radix is not None:
            self.radix.evict(n - self.pool.num_free)
        try:
            return self.pool.allocate(n)
        except OutOfPages:
            return None

    def ensure_pages(self, r: Request, num_tokens: int, unpin: bool = False) -> bool:
        """Give r pages for num_tokens; ``unpin``: if eviction is not enough, release the
        conversations' pins (``pins.release_all``) and evict again."""
        need = PagePool.pages_for(num_tokens, self.page_size) - len(r.pages)
        if need <= 0:
            return True
        pages = self._allocate(need)
        if pages is None and unpin and self.pins is not None:
            self.pins.release_all()
            pages = self._allocate(need)
        if pages is None:
            return False
        r.pages.extend(pages)
        return True

    def share_progress(self, r: Request) -> None:
        """Insert r's computed whole pages into the cache while it runs, and re-point r at
        the cached pages (lock moved to the deeper node). A page r computed in duplicate of
        one another request inserted first is swapped for the cached one and freed.

        Incremental: only the pages past ``r.num_shared`` are walked, from ``r.cache_node``
        (a locked node keeps covering exactly ``token_ids[:num_shared]``: splits keep the
        lower half as the same object, and eviction never touches it). Walking from the
        root on each page made a long decode quadratic (8k tokens: 0.47 s per request)."""
        if self.radix is None:
            return
        n = (r.num_computed // self.page_size) * self.page_size
        if n == 0 or n <= r.num_shared:
            return
        ps = self.page_size
        old = r.cache_node
        start = r.num_shared if old is not None else 0
        first, npages = start // ps, n // ps
        tokens, mine = r.token_ids[start:n], r.pages[first:npages]
        self.radix.insert(tokens, mine, under=old)
        m = self.radix.match_prefix(tokens, under=old)
        assert m.num_tokens == n - start, "just-inserted prefix not found in the cache"
        self.pool.incref(m.pages)  # before the decref below: the same page may be in both
        self.pool.decref(mine)
        if old is not None:
            self.radix.move_lock(old, m.node)
        else:
            self.radix.lock(m.node)
        r.cache_node = m.node
        r.pages[first:npages] = m.pages
        r.pages_version += 1
        r.num_shared = n

    def release(self, r: Request, cache_tokens: bool) -> None:
        """Give back r's pages; with cache_tokens, first offer its computed KV to the cache."""
        if self.radix is not None and cache_tokens and r.pages:
            n = (r.num_computed // self.page_size) * self.page_size
            if n:
                self.radix.insert(r.token_ids[:n], r.pages[: n // self.page_size])
        if self.radix is not None and r.cache_node is not None:
            self.radix.unlock(r.cache_node)
        r.cache_node = None
        r.num_shared = 0
        self.pool.decref(r.pages)
        r.pages = []
        r.pages_version += 1

    def reset(self) -> None:
        """Forget every page reference: all pages free, the prefix cache empty. Only for
        when the holders' page tables cannot be trusted (a step cut short), and only after
        every holder dropped its pages without giving them back (conversation pins are
        emptied here)."""
        if self.pins is not None:
            self.pins.forget_all()
        self.pool.reset()
        if self.radix is not None:
            self.radix.forget()

    def check_integrity(self, holders: list) -> None:
        """free + cached-only + in use by requests == total (tests call this after every step).

        ``holders``: running requests (anything with ``.pages``); conversation pins are added here."""
        holders = list(holders) + (self.pins.holders() if self.pins is not None else [])
        self.pool.check_integrity()
        in_use = set()
        for r in holders:
            assert len(set(r.pages)) == len(r.pages), "a request holds a page twice"
            in_use.update(r.pages)
        if self.radix is not None:
            self.radix.check_integrity()
            self.radix.check_accounting(len(in_use))
        else:
            assert self.pool.num_free + len(in_use) == self.pool.num_pages, (
                f"page leak: free {self.pool.num_free} + in use {len(in_use)} != {self.pool.num_pages}"
            )
