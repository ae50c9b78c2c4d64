"""The page tables of a step's requests, kept across steps and updated incrementally.

Attention reads each sequence's KV through its row of the step's block table ([B, max pages]
int32, padded). Built from scratch each step, that is every page id of every running request
through Python: 1.8 ms for 256 requests of 2k tokens (128 pages each), more than the whole
host budget of a GPU decode step. But a request's page list rarely changes: decoding adds a
page every page_size tokens, and only admission, a prefix-cache swap (``share_progress``)
and preemption rewrite it.

So each request keeps a row of one persistent host table (its *slot*), and a step writes only
what changed: the pages appended since the last step (by length), or the whole row when the
cache manager bumped ``Request.pages_version`` (any change that is not an append). The
step's table is then one gather of the batch's slot rows (numpy, in C). Slots of requests
that finished or lost their pages are reclaimed when the table runs out of them.
"""

from __future__ import annotations

import weakref

import numpy as np

from ..engine.request import Request


class BlockTables:
    """Slot rows of page ids, one per request seen, grown on demand."""

    def __init__(self, rows: int = 64, cols: int = 64) -> None:
        self.table = np.zeros((max(1, rows), max(1, cols)), dtype=np.int32)
        # weak: a finished request is not kept alive by the slot it held
        self._owner: list[weakref.ref | None] = [None] * self.table.shape[0]
        self._free = list(range(self.table.shape[0] - 1, -1, -1))

    def gather(self, requests: list[Request], num_pages: list[int], width: int) -> np.ndarray:
        """[len(requests), width] int32: the first ``num_pages[i]`` entries of row i are
        request i's first pages; the rest is padding (stale but valid page ids, masked by the
        kernels through the context lengths)."""
        if width > self.table.shape[1]:
            self._grow(cols=max(width, 2 * self.table.shape[1]))
        slots = [self._sync(r, n) for r, n in zip(requests, num_pages)]
        return self.table[slots, :width]

    def _sync(self, r: Request, need: int) -> int:
        slot = r.table_slot
        if slot < 0 or (owner := self._owner[slot]) is None or owner() is not r:
            slot = r.table_slot = self._take(r)
            r.table_version, r.table_len = -1, 0
        pages = r.pages
        if len(pages) > self.table.shape[1]:
            self._grow(cols=max(len(pages), 2 * self.table.shape[1]))
        if r.table_version != r.pages_version:
            self.table[slot, : len(pages)] = pages
            r.table_version, r.table_len = r.pages_version, len(pages)
        elif len(pages) > r.table_len:
            self.table[slot, r.table_len : len(pages)] = pages[r.table_len :]
            r.table_len = len(pages)
        assert need <= r.table_len, "a step reads pages its request does not hold"
        return slot

    def _take(self, r: Request) -> int:
        if not self._free:
            # Reclaim the slots of requests that ended or gave their pages back (preempted:
            # they get a slot again when they return).
            for s, ref in enumerate(self._owner):
                owner = ref() if ref is not None else None
                if ref is not None and (owner is None or owner.finished or not owner.pages):
                    if owner is not None:
                        owner.table_slot = -1
                    self._owner[s] = None
                    self._free.append(s)
        if not self._free:
            self._grow(rows=2 * self.table.shape[0])
        s = self._free.pop()
        self._owner[s] = weakref.ref(r)
        return s

    def _grow(self, rows: int | None = None, cols: int | None = None) -> None:
        old = self.table
        r, c = rows or old.shape[0], cols or old.shape[1]
        self.table = np.zeros((r, c), dtype=np.int32)
        self.table[: old.shape[0], : old.shape[1]] = old
        if r > old.shape[0]:
            self._owner.extend([None] * (r - old.shape[0]))
            self._free.extend(range(r - 1, old.shape[0] - 1, -1))
