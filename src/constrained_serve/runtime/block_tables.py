"""The page tables of a step's requests, kept across steps and updated incrementally.

Attention reads each sequence's KV through its row of the step's block table ([B, max pages]
int32, padded). Built from scratch each step, that is every page id of every running request
through Python: 1.8 ms for 256 requests of 2k tokens (128 pages each), more than the whole
host budget of a GPU decode step. But a request's page list rarely changes: decoding adds a
page every page_size tokens, and only admission, a prefix-cache swap (``share_progress``)
and preemption rewrite it.

So each request of a step keeps a row of one persistent host table (its *slot*), and a step
writes only what changed: the pages appended since the last step (by length), or the whole
row when the cache manager bumped ``Request.pages_version`` (any change that is not an
append). The step's table is then one gather of the batch's slot rows (numpy, in C).

What the table knows of a request (its slot, the page-list version and length written there)
lives here, keyed by request id, and only for the requests of the latest step: a request not
in a step (finished, preempted, or left out by the token budget) gives its slot back then,
and if it comes back its row is written whole again. The engine also releases a finished
request's row at once (``release``). So nothing outlives its request.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..engine.request import Request


@dataclass
class _Row:
    """A request's slot, and the page list it holds: ``version`` (of ``Request.pages_version``)
    and the first ``length`` pages."""

    slot: int
    version: int = -1
    length: int = 0


class BlockTables:
    """Slot rows of page ids, one per request of the latest step, grown on demand."""

    def __init__(self, rows: int = 64, cols: int = 64) -> None:
        self.table = np.zeros((max(1, rows), max(1, cols)), dtype=np.int32)
        self._rows: dict[int, _Row] = {}  # request id -> its row, for the latest step's requests
        self._free = list(range(self.table.shape[0] - 1, -1, -1))

    def __len__(self) -> int:
        """Requests holding a slot (those of the latest gather)."""
        return len(self._rows)

    def gather(self, requests: list[Request], num_pages: list[int], width: int) -> np.ndarray:
        """[len(requests), width] int32: the first ``num_pages[i]`` entries of row i are
        request i's first pages; the rest is padding (stale but valid page ids, masked by the
        kernels through the context lengths). The slots of requests not given go back."""
        if width > self.table.shape[1]:
            self._grow(cols=max(width, 2 * self.table.shape[1]))
        old, self._rows = self._rows, {}
        for r in requests:  # rows kept from the last step
            row = old.pop(r.request_id, None)
            if row is not None:
                self._rows[r.request_id] = row
        for row in old.values():  # requests not in this step: their slots go back
            self._free.append(row.slot)
        slots = [self._sync(r, n) for r, n in zip(requests, num_pages)]
        return self.table[slots, :width]

    def release(self, request_id: int) -> None:
        """Forget a request (it finished): its slot goes back now."""
        row = self._rows.pop(request_id, None)
        if row is not None:
            self._free.append(row.slot)

    def _sync(self, r: Request, need: int) -> int:
        row = self._rows.get(r.request_id)
        if row is None:
            row = self._rows[r.request_id] = _Row(self._take())
        pages = r.pages
        if len(pages) > self.table.shape[1]:
            self._grow(cols=max(len(pages), 2 * self.table.shape[1]))
        if row.version != r.pages_version:
            self.table[row.slot, : len(pages)] = pages
            row.version, row.length = r.pages_version, len(pages)
        elif len(pages) > row.length:
            self.table[row.slot, row.length : len(pages)] = pages[row.length :]
            row.length = len(pages)
        assert need <= row.length, "a step reads pages its request does not hold"
        return row.slot

    def _take(self) -> int:
        if not self._free:
            self._grow(rows=2 * self.table.shape[0])
        return self._free.pop()

    def _grow(self, rows: int | None = None, cols: int | None = None) -> None:
        old = self.table
        r, c = rows or old.shape[0], cols or old.shape[1]
        self.table = np.zeros((r, c), dtype=np.int32)
        self.table[: old.shape[0], : old.shape[1]] = old
        if r > old.shape[0]:
            self._free.extend(range(r - 1, old.shape[0] - 1, -1))
