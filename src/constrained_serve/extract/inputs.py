"""The input side of the extraction job: JSONL lines (or records) to ``InputItem``s, each a
chat prompt for the model or an error row found before the model sees it (bad UTF-8 or
JSON, not an object, a missing or unusable field). ``job.py`` runs the items; nothing here
needs a model.

Resume: ``read_items`` skips the keys ``output.open_sinks`` found already written (the id,
or the line for rows that carry one), so a rerun after ``kill -9`` writes exactly the rows
still missing.
"""

from __future__ import annotations

import json
import logging
import os
import re
import string
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from .output import written_row_key

logger = logging.getLogger(__name__)

# Error types written in error rows for problems found before the model sees a line.
INVALID_UTF8 = "invalid_utf8"
INVALID_JSON = "invalid_json"
NOT_OBJECT = "not_object"
INVALID_ID = "invalid_id"
INVALID_TEXT = "invalid_text"
MISSING_FIELD = "missing_field"


def error_object(kind: str, message: str) -> dict[str, str]:
    """The "error" object of a row."""
    return {"type": kind, "message": message}


# ---------------------------------------------------------------------------------------
# Input side: lines -> items
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class InputItem:
    """One non-blank input line: either chat messages for the model, or an early error."""

    line_no: int
    id: Any  # the input's id field, or the 1-based line number when it has none
    messages: list[dict[str, str]] | None = None
    error: dict[str, str] | None = None
    # The row carries its line number and is keyed by it: the line has no usable id of its
    # own, or it repeats the id of an earlier line (ids do not say which line a row is for).
    by_line: bool = False

    @property
    def key(self) -> str:
        """Its resume key: the key its output row will be found under."""
        return written_row_key(self.row_head())

    def row_head(self) -> dict[str, Any]:
        """The first fields of this line's output row. A row whose id is its line number also
        says so ("line"): its resume key is then the line, apart from every real id, so a
        line with the explicit id 5 is not taken for the id-less line 5. So does the row of a
        line that repeats an earlier line's id."""
        return {"id": self.id, "line": self.line_no} if self.by_line else {"id": self.id}


_FIELD_NAME = re.compile(r"^[^\W\d][\w-]*$")


class PromptBuilder:
    """Turns one input record into chat messages.

    The system message (``instructions``) is the same for every line, so it is a shared
    token prefix that the engine's prefix cache computes once for the whole file.
    """

    def __init__(self, field: str = "text", template: str | None = None, instructions: str | None = None):
        self.template = template if template is not None else "{" + field + "}"
        self.instructions = instructions
        # Validate the template once, up front: a bad template is a usage error, not 10k error rows.
        try:
            parts = [
                (name, spec, conv)
                for _, name, spec, conv in string.Formatter().parse(self.template)
                if name is not None
            ]
        except ValueError as e:
            raise ValueError(f"bad --template {self.template!r}: {e}") from None
        self.fields = [name for name, _, _ in parts]
        if not self.fields:
            raise ValueError(f"--template {self.template!r} names no field; use e.g. '... {{text}} ...'")
        if template is None and not _FIELD_NAME.match(field):
            raise ValueError(
                f"--field {field!r} is not a plain field name (nested fields such as a.b are not "
                "supported; a --template can combine several top-level fields)"
            )
        for name, spec, conv in parts:
            if not _FIELD_NAME.match(name):
                raise ValueError(
                    f"--template field {{{name}}} is not a plain field name (positional, index and "
                    "attribute lookups are not supported; write {{ and }} for literal braces)"
                )
            if spec or conv:
                raise ValueError(
                    f"--template field {{{name}{'!' + conv if conv else ''}{':' + spec if spec else ''}}}: "
                    "format specs and conversions are not supported (fields are inserted as text)"
                )

    def build(self, record: Mapping[str, Any]) -> list[dict[str, str]]:
        """Chat messages for ``record``; KeyError naming the field when one is missing."""
        values: dict[str, str] = {}
        for name in self.fields:
            value = record.get(name)
            if value is None:
                raise KeyError(name)
            values[name] = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        user = self.template.format_map(values)
        user.encode("utf-8")  # UnicodeEncodeError (a ValueError) on a lone surrogate from a \udXXX escape
        messages = [{"role": "user", "content": user}]
        if self.instructions:
            messages.insert(0, {"role": "system", "content": self.instructions})
        return messages


def _line_error(line_no: int, kind: str, message: str) -> InputItem:
    """A line refused before its id could be read: the line number stands in for the id."""
    return InputItem(line_no, line_no, error=error_object(kind, message), by_line=True)


def _parse_line(raw: bytes, line_no: int, builder: PromptBuilder, id_field: str) -> InputItem:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return _line_error(line_no, INVALID_UTF8, f"line {line_no} is not valid UTF-8: {e}")
    if line_no == 1:
        text = text.lstrip("\ufeff")  # a byte-order mark some editors write
    try:
        record = json.loads(text)
    except (ValueError, RecursionError) as e:  # also: nesting too deep, an integer too long to read
        return _line_error(line_no, INVALID_JSON, f"line {line_no} is not valid JSON: {type(e).__name__}: {e}")
    if not isinstance(record, dict):
        kind = type(record).__name__
        return _line_error(line_no, NOT_OBJECT, f"line {line_no} is a JSON {kind}, not an object")
    return parse_record(record, line_no, builder, id_field)


def parse_record(record: Mapping[str, Any], line_no: int, builder: PromptBuilder, id_field: str = "id") -> InputItem:
    """The item for one input record (a JSON object already read): its id, and its chat
    messages or the error that keeps it from the model. Also used for records that come
    from elsewhere than a JSONL line (a Ray Dataset row), with their position as line_no."""
    row_id = record.get(id_field)
    from_line = row_id is None
    if from_line:
        row_id = line_no
    elif isinstance(row_id, bool) or not isinstance(row_id, (str, int)):
        msg = f"line {line_no}: {id_field!r} must be a string or an integer, got {json.dumps(row_id)[:80]}"
        return _line_error(line_no, INVALID_ID, msg)
    try:
        messages = builder.build(record)
    except KeyError as e:
        msg = f"line {line_no} has no field {e.args[0]!r} (or it is null)"
        return InputItem(line_no, row_id, error=error_object(MISSING_FIELD, msg), by_line=from_line)
    except UnicodeEncodeError as e:
        msg = f"line {line_no}: the text is not valid Unicode (a lone surrogate {e.object[e.start : e.end]!a})"
        return InputItem(line_no, row_id, error=error_object(INVALID_TEXT, msg), by_line=from_line)
    return InputItem(line_no, row_id, messages=messages, by_line=from_line)


def read_items(
    lines: Iterable[bytes],
    builder: PromptBuilder,
    *,
    id_field: str = "id",
    done: set[str] | None = None,
    on_skip: Callable[[InputItem], None] | None = None,
) -> Iterator[InputItem]:
    """Items for every non-blank line whose id is not in ``done``, in input order.

    Blank lines are skipped silently (a trailing newline is common in JSONL); they still
    count for line numbers, so a line number always points into the file. A line whose id
    an earlier line already has is still run, and its row is keyed by its line number (a
    rerun then resumes it apart from the first one).
    """
    done = done or set()
    first_line: dict[str, int] = {}  # id key -> the line that had it first
    repeats = 0
    for line_no, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        item = _parse_line(raw, line_no, builder, id_field)
        if not item.by_line:
            first = first_line.setdefault(item.key, line_no)
            if first != line_no:
                repeats += 1
                if repeats <= 5:
                    logger.warning(
                        'line %d repeats the id %s of line %d: its row carries "line": %d%s',
                        line_no,
                        item.key,
                        first,
                        line_no,
                        " (further repeated ids are not reported)" if repeats == 5 else "",
                    )
                item = replace(item, by_line=True)
        if item.key in done:
            if on_skip is not None:
                on_skip(item)
            continue
        yield item


def count_rows(path: str) -> int | None:
    """Non-blank lines of a file, streamed (for the progress bar's total). None for what is
    not a regular file (a pipe, /dev/stdin): reading it here would leave nothing to process."""
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return sum(1 for raw in f if raw.strip())
