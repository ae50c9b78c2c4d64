"""The extract job's progress line on a terminal: rows, and the tokens under way.

Rows alone do not move while the engine decodes: with ``--max-in-flight 256`` all 36 demo
rows are decoded together and finish within the last seconds, so a row bar sat at 0% for
44 of 46 s with an ETA of 25 min. So the line also shows the tokens generated so far (of
written rows and of rows still decoding), the rows in flight, and an ETA from tokens:

    extract  37%|███▋      | 9/36 rows, 0.41 rows/s, 1893 tok (86/s), 27 in flight, ETA 0:31

The bar counts a row in flight as done in proportion to its tokens over the tokens a row
takes (the mean of the rows written so far; before the first, ``--max-tokens``, so the bar
and the ETA err long, and the ETA reads "<=": an upper bound at the current rate).

A daemon thread refreshes the line twice a second from ``activity()`` (rows in flight,
their tokens); ``row()`` is called as rows are written. Locally ``activity`` is the engine's
``Driver.activity``; for a Ray job it is ``ray.progress_board.BoardActivity``, the sum of
what the replicas report while their batches decode (a batch's rows come back together at
its end, so rows alone would sit still meanwhile). Without ``activity`` the line is rows
and rows/s, without an ETA: a rate from rows that come back a batch at a time swings from
hours to seconds within a batch.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

REFRESH_S = 0.5


def _clock(seconds: float) -> str:
    seconds = int(seconds + 0.5)
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class ExtractProgress:
    """A tqdm line for the extract job (on stderr), refreshed by rows and by a timer."""

    def __init__(
        self,
        total: int | None,
        done_before: int,
        max_tokens: int,
        activity: Callable[[], tuple[int, int]] | None = None,
    ):
        from tqdm import tqdm

        self.total = total  # rows to write in this run (None: unknown, e.g. stdin)
        self.max_tokens = max(1, max_tokens)
        self._activity = activity
        self._rows = 0
        self._errors = 0
        self._row_tokens = 0  # completion tokens of rows written
        self._tokens_shown = 0  # never goes back (a row finished but not written yet leaves both counts)
        self._started = time.perf_counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # A terminal that reports 0 columns or rows (some ptys, `script`) would get an empty
        # bar, or none at all (tqdm hides bars below the last row): fall back to 100 x 20.
        size = shutil.get_terminal_size((100, 20))
        # The words go in tqdm's desc: its postfix field would start with ", ".
        fmt = "extract {percentage:3.0f}%|{bar}| {desc}" if total else "extract: {desc}"
        self._bar = tqdm(
            total=total or None,
            unit="row",
            ncols=size.columns or 100,
            nrows=size.lines or 20,
            file=sys.stderr,
            bar_format=fmt,
        )
        self._bar.set_description_str(f"{done_before} rows already done" if done_before else "starting", refresh=True)
        self._timer = None
        if activity is not None:
            self._timer = threading.Thread(target=self._tick, name="extract-progress", daemon=True)
            self._timer.start()

    # -- inputs --------------------------------------------------------------------------
    def row(self, row: dict[str, Any]) -> None:
        """A row was written (on_row of the job)."""
        with self._lock:
            self._rows += 1
            self._errors += "error" in row
            self._row_tokens += (row.get("usage") or {}).get("completion_tokens", 0)
            self._draw()

    def close(self) -> None:
        self._stop.set()
        if self._timer is not None:
            self._timer.join(timeout=2 * REFRESH_S)
        with self._lock:
            self._draw()
            self._bar.close()

    # -- the line ------------------------------------------------------------------------
    @property
    def text(self) -> str:
        """The line's words (rows, rates, tokens, rows in flight, ETA, errors)."""
        return self._bar.desc or ""

    @property
    def fraction(self) -> float:
        """How full the bar is (0..1; 0 without a total)."""
        return self._bar.n / self.total if self.total else 0.0

    def _tick(self) -> None:
        while not self._stop.wait(REFRESH_S):
            with self._lock:
                if self._stop.is_set():
                    return
                self._draw()

    def refresh(self) -> None:
        """Recompute and redraw the line now."""
        with self._lock:
            self._draw()

    def _draw(self) -> None:  # under self._lock
        in_flight, flight_tokens = self._activity() if self._activity is not None else (0, 0)
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        tokens = self._tokens_shown = max(self._tokens_shown, self._row_tokens + flight_tokens)
        # Tokens a row takes: the written rows' mean, else --max-tokens (an upper bound).
        measured = self._rows > 0 and self._row_tokens > 0
        per_row = self._row_tokens / self._rows if measured else float(self.max_tokens)
        of = f"/{self.total}" if self.total else ""
        parts = [f"{self._rows}{of} rows", f"{self._rows / elapsed:.2f} rows/s"]
        if self._activity is not None:
            parts.append(f"{tokens} tok ({tokens / elapsed:.0f}/s)")
            parts.append(f"{in_flight} in flight")
        done = float(self._rows)
        if self._activity is not None and in_flight:
            done += min(flight_tokens / per_row, in_flight * 0.99)  # a row in flight is not written yet
        if self.total:
            self._bar.n = min(done, float(self.total))
            left = max(self.total - self._rows, 0)
            rate = tokens / elapsed if self._activity is not None else 0.0
            if left and rate > 0:
                eta = max(left * per_row - flight_tokens, 0.0) / rate
                parts.append(f"ETA {'' if measured else '<='}{_clock(eta)}")
        if self._errors:
            parts.append(f"errors {self._errors}")
        self._bar.set_description_str(", ".join(parts), refresh=False)
        self._bar.refresh()
