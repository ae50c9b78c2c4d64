"""The output side of the extract job: resume keys, and the JSONL file rows are appended to.

Every row is one ``write`` of a complete line followed by a flush, so the only damage a
killed writer can leave is a partial last line. ``open_sinks`` locks the output file(s),
cuts that line and returns the keys of the rows already written: an input line whose key
is among them is done (``job.read_items`` skips it).

A row's key is its id, or its line number for rows that carry ``"line"`` (lines without a
usable id, and lines repeating an earlier line's id; see ``job.InputItem.row_head``).
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


# Every row is a dict whose first key is "id", written by json.dumps: a partial last line
# that we wrote starts with these bytes.
_ROW_START = b'{"id": '


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
            if not _partial_row(raw):  # not the start of a row we write: not ours to cut
                raise OutputFileError(
                    f"{path}: line {line_no} is not an output row and has no newline; "
                    "not appending to it (is this the right file?)"
                )
            logger.warning("%s: dropping a partial last line (%d bytes) left by an interrupted run", path, len(raw))
            break
        good_end += len(raw)
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise OutputFileError(f"{path}: line {line_no} is not a JSON row ({e}); not appending to it") from None
        if not _is_row(row):
            raise OutputFileError(
                f"{path}: line {line_no} is not an output row (no 'id' with 'output' or "
                "'error'); not appending to it (is this the right file?)"
            )
        keys.add(written_row_key(row))
        rows += 1
    f.truncate(good_end)
    f.seek(0, os.SEEK_END)
    return keys, rows


def _is_row(row: Any) -> bool:
    return isinstance(row, dict) and "id" in row and ("output" in row or "error" in row)


def _partial_row(raw: bytes) -> bool:
    """A last line without its newline that a killed run of ours can have left: the start of
    a row (a cut row never parses), or a whole row whose newline was not written yet."""
    if not raw.startswith(_ROW_START):
        return False
    try:
        return _is_row(json.loads(raw))
    except (ValueError, RecursionError):
        return True


class JsonlSink:
    """An output file opened for resumable appends: locked, repaired, one row per write."""

    def __init__(self, path: str, flag: str = "-o"):
        self.path = path
        if os.path.exists(path) and not os.path.isfile(path):
            raise OutputFileError(
                f"{flag} {path}: not a regular file (the output is appended to and "
                "re-read on resume, so it must be a file)"
            )
        self.created = not os.path.exists(path)
        try:
            self._f = open(path, "a+b")
        except OSError as e:
            raise OutputFileError(f"{flag} {path}: cannot open for writing: {e.strerror or e}") from None
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
        try:
            line = json.dumps(row, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate (from an input's \udXXX escape): escape it
            line = json.dumps(row).encode("ascii")
        self._f.write(line + b"\n")
        self._f.flush()

    def close(self) -> None:
        if self._f.closed:
            return
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()

    def remove_if_unused(self) -> None:
        """Close, and delete the file if this run created it and wrote nothing (setup failed)."""
        self.close()
        if self.created and os.path.getsize(self.path) == 0:
            os.unlink(self.path)


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

    def remove_if_unused(self) -> None:
        self.out.remove_if_unused()
        if self.errors is not None:
            self.errors.remove_if_unused()


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.realpath(a) == os.path.realpath(b) or os.path.samefile(a, b)
    except OSError:  # one of them does not exist yet
        return False


def open_sinks(output: str, errors: str | None = None, input_path: str | None = None) -> Sinks:
    """Open (lock, repair, scan) the output and the optional errors file. ``input_path``: the
    input file, which neither may be (resuming would cut and skip the input's own lines)."""
    for flag, path in (("-o", output), ("--errors", errors)):
        if path == "-":
            raise OutputFileError(
                f"{flag} - (stdout) is not supported: the output must be a file, which a rerun resumes"
            )
        if path is not None and input_path not in (None, "-") and _same_file(path, input_path):
            raise OutputFileError(f"{flag} {path} is the input file; write the output to another file")
    if errors is not None and _same_file(errors, output):
        raise OutputFileError("--errors must be a different file from the output")
    out = JsonlSink(output)
    try:
        return Sinks(out, JsonlSink(errors, "--errors") if errors else None)
    except BaseException:
        out.close()
        raise
