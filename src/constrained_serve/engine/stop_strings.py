"""Stop strings on the detokenized text of a request: found incrementally (only the text added
since the last check is searched, plus enough before it for a stop string that straddles the
boundary), and for grammar-forced tokens, where in them a stop string is completed."""

from __future__ import annotations

import copy

from .request import Request


def forced_until_stop(r: Request, forced: list[int]) -> int:
    """How many of ``forced`` to append: up to the token whose text completes a stop
    string (all of them if none does), as had they been sampled one at a time."""
    detok = copy.copy(r.detok)
    detok.ids = list(detok.ids)
    start = _scan_start(r)
    for i, t in enumerate(forced):
        detok.push([t])
        if any(detok.text.find(s, start) >= 0 for s in r.params.stop):
            return i + 1
    return len(forced)


def _scan_start(r: Request) -> int:
    """Where a stop string could begin in text added since the last check: the scanned
    part minus enough for a stop string that straddles the boundary."""
    return max(0, r.text_state.stop_scanned - max(len(s) for s in r.params.stop) + 1)


def stop_string_seen(r: Request) -> str | None:
    """The stop string that occurs first in the text, or None. Searches only the text
    added since the last check, plus enough before it for a stop string that straddles
    the boundary (a fast-forward can add many characters at once)."""
    text = r.detok.text
    start = _scan_start(r)
    r.text_state.stop_scanned = len(text)
    found = [(i, s) for s in r.params.stop if (i := text.find(s, start)) >= 0]
    return min(found)[1] if found else None
