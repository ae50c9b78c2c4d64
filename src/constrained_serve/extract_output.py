"""The output side of the extract job: resume keys, and the JSONL file rows are appended to.

Every row is one ``write`` of a complete line followed by a flush, so the only damage a
killed writer can leave is a partial last line. ``open_sinks`` locks the output file(s),
cuts that line and returns the keys of the rows already written: an input line whose key
is among them is done (``extract.read_items`` skips it).

A row's key is its id, or its line number for rows that carry ``"line"`` (lines without a
usable id, and lines repeating an earlier line's id; see ``extract.InputItem.row_head``).
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import IO, Any

try:
    import fcntl
except ImportError:  # not POSIX (Windows): resume still works, only the two-writer guard is lost
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)


class OutputFileError(Exception):
    """An existing output file that cannot be resumed safely (corrupt row, locked)."""


def row_key(row_id: Any) -> str:
    """Key of an id in the resume set. JSON text, so the id 1 and the id "1" stay distinct."""
    return json.dumps(row_id, sort_keys=True, ensure_ascii=False)


def written_row_key(row: dict[str, Any]) -> str:
    """The resume key of a row already in the output (see InputItem.row_head)."""
    return f"line {row['line']}" if "line" in row else row_key(row["id"])


def scan_and_repair(f: IO[bytes], path: str) -> tuple[set[str], int]:
    """Read the rows already in ``f``, cut a partial last line, return (id keys, #rows).

    A line without its newline can only be a write cut short by a crash, so it is dropped
    and that row is recomputed. A complete line that is not a JSON row is corruption we
    did not make: refuse rather than guess.
    """
    f.seek(0)
    keys: set[str] = set()
    rows = 0
    good_end = 0
    for line_no, raw in enumerate(f, 1):
        if not raw.endswith(b"\n"):
            logger.warning("%s: dropping a partial last line (%d bytes) left by an interrupted run", path, len(raw))
            break
        good_end += len(raw)
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise OutputFileError(f"{path}: line {line_no} is not a JSON row ({e}); not appending to it") from None
        if not isinstance(row, dict) or "id" not in row:
            raise OutputFileError(f"{path}: line {line_no} is not an output row (no 'id'); not appending to it")
        keys.add(written_row_key(row))
        rows += 1
    f.truncate(good_end)
    f.seek(0, os.SEEK_END)
    return keys, rows


class JsonlSink:
    """An output file opened for resumable appends: locked, repaired, one row per write."""

    def __init__(self, path: str):
        self.path = path
        self._f = open(path, "a+b")
        try:
            # Two runs appending to one file would interleave rows; the lock makes the
            # second one fail fast. The OS drops it when the process dies, even on kill -9.
            if fcntl is not None:
                fcntl.flock(self._f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._f.close()
            raise OutputFileError(f"{path} is being written by another run") from None
        try:
            self.done, self.rows_before = scan_and_repair(self._f, path)
        except BaseException:
            self._f.close()
            raise

    def write(self, row: dict[str, Any]) -> None:
        # One write of a whole line, then flush: a kill can cut at most this line short,
        # which the next run's scan_and_repair removes.
        self._f.write(json.dumps(row, ensure_ascii=False).encode("utf-8") + b"\n")
        self._f.flush()

    def close(self) -> None:
        if self._f.closed:
            return
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()


@dataclass
class Sinks:
    """Where rows go: everything to ``out``, or error rows to ``errors`` when given."""

    out: JsonlSink
    errors: JsonlSink | None = None

    @property
    def done(self) -> set[str]:
        return self.out.done | (self.errors.done if self.errors else set())

    def write(self, row: dict[str, Any]) -> None:
        sink = self.errors if (self.errors is not None and "error" in row) else self.out
        sink.write(row)

    def close(self) -> None:
        self.out.close()
        if self.errors is not None:
            self.errors.close()


def open_sinks(output: str, errors: str | None = None) -> Sinks:
    if errors is not None and os.path.realpath(errors) == os.path.realpath(output):
        raise OutputFileError("--errors must be a different file from the output")
    out = JsonlSink(output)
    try:
        return Sinks(out, JsonlSink(errors) if errors else None)
    except BaseException:
        out.close()
        raise
