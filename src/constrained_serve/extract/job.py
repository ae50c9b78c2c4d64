"""The resumable JSONL extraction job behind ``constrained-serve extract``.

Data flow (all streaming, so inputs larger than memory are fine)::

    input.jsonl --read_items()--> InputItem (prompt, or an error found before the model)
        --run_extract()--> engine.generate_iter(prompts)  (continuous batching, input order)
        --> rows, merged back into input order --> JsonlSink (output.py: append + flush per row)

Resume: ``output.open_sinks`` locks the output file(s), truncates a partial last
line left by a crash and returns the keys of the rows already written; ``read_items``
skips those keys (the id, or the line for rows that carry one). So ``kill -9`` then a
rerun gives exactly one row per input line.

Nothing here needs a model: ``run_extract`` takes any object with the Engine's
``generate_iter`` and the rest is plain file logic, unit-tested on its own.
"""

from __future__ import annotations

import json
import logging
import os
import re
import string
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
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
TRUNCATED = "truncated"
INVALID_OUTPUT = "invalid_output"


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
    return InputItem(line_no, line_no, error=_err(kind, message), by_line=True)


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
        return InputItem(line_no, row_id, error=_err(MISSING_FIELD, msg), by_line=from_line)
    except UnicodeEncodeError as e:
        msg = f"line {line_no}: the text is not valid Unicode (a lone surrogate {e.object[e.start : e.end]!a})"
        return InputItem(line_no, row_id, error=_err(INVALID_TEXT, msg), by_line=from_line)
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


def _err(kind: str, message: str) -> dict[str, str]:
    return {"type": kind, "message": message}


# ---------------------------------------------------------------------------------------
# Results -> rows, and the job loop
# ---------------------------------------------------------------------------------------


def error_type_name(name: str | None) -> str:
    """The engine reports exception class names ("PromptTooLongError"); rows use the
    snake_case style of the CLI's own types ("prompt_too_long")."""
    if not name or name in ("ValueError", "Exception"):  # too generic to name the problem
        return INVALID_OUTPUT
    if name.endswith("Error") and len(name) > 5:
        name = name[: -len("Error")]
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


def usage_dict(result: Any) -> dict[str, int]:
    usage = getattr(result, "usage", None)
    names = ("prompt_tokens", "cached_tokens", "completion_tokens", "forced_tokens")
    return {n: int(getattr(usage, n, 0) or 0) for n in names}


def result_row(
    row_id: Any, result: Any, *, json_output: bool, max_tokens: int | None = None, spans: bool = False
) -> dict[str, Any]:
    """The output row for one engine Result.

    A truncated output (finish_reason "length" before the constraint was complete) is an
    error row of type "truncated" carrying the partial text, so the output file (or the
    ok stream, with --errors) holds only complete, valid outputs.
    """
    finish = getattr(result, "finish_reason", None)
    usage = usage_dict(result)
    text = getattr(result, "text", "") or ""
    error = getattr(result, "error", None)
    if finish == "abort" or (error and finish != "length"):
        kind = error_type_name(getattr(result, "error_type", None))
        row_err = _err(kind, error or "the request was aborted")
        if text:  # what the model wrote (for output_validation: JSON the Pydantic type refused)
            row_err["text"] = text
        return {"id": row_id, "error": row_err, "finish_reason": finish, "usage": usage}
    value = getattr(result, "json", None) if json_output else text
    dump = getattr(getattr(result, "parsed", None), "model_dump", None)
    if json_output and callable(dump):
        # A Pydantic model's own view: a schema from model_json_schema() leaves
        # additionalProperties open, so the raw JSON may hold keys the model ignores.
        # by_alias: the keys the schema (and so the output) uses.
        value = dump(mode="json", by_alias=True)
    if finish == "length" and (not json_output or value is None):
        if max_tokens is not None and usage["completion_tokens"] < max_tokens:
            msg = (
                f"output stopped at the model's context length ({usage['prompt_tokens']} prompt + "
                f"{usage['completion_tokens']} output tokens); shorten the input"
            )
        else:
            msg = error or f"output truncated at max_tokens ({usage['completion_tokens']} tokens); raise --max-tokens"
        return {"id": row_id, "error": {**_err(TRUNCATED, msg), "text": text}, "finish_reason": finish, "usage": usage}
    if json_output and value is None:
        row_err = {**_err(INVALID_OUTPUT, "the output did not parse as JSON"), "text": text}
        return {"id": row_id, "error": row_err, "finish_reason": finish, "usage": usage}
    row = {"id": row_id, "output": value, "finish_reason": finish, "usage": usage}
    confidence = getattr(result, "field_confidence", None)
    if confidence is not None:  # --confidence: per JSON path, the probability the model gave it
        row["confidence"] = {path: float(f"{p:.6g}") for path, p in confidence.items()}
    if spans:  # --spans: per JSON path of a grounded value, where it stands in the text
        row["spans"] = {path: list(span) for path, span in (getattr(result, "spans", None) or {}).items()}
    return row


@dataclass
class JobStats:
    """Counters for the progress bar and the closing summary."""

    ok: int = 0
    failed: int = 0
    truncated: int = 0
    skipped: int = 0  # already in the output from an earlier run
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    started: float = field(default_factory=time.perf_counter)

    @property
    def rows(self) -> int:
        return self.ok + self.failed + self.truncated

    def add(self, row: Mapping[str, Any]) -> None:
        if "error" not in row:
            self.ok += 1
        elif row["error"].get("type") == TRUNCATED:
            self.truncated += 1
        else:
            self.failed += 1
        usage = row.get("usage") or {}
        self.prompt_tokens += usage.get("prompt_tokens", 0)
        self.cached_tokens += usage.get("cached_tokens", 0)
        self.completion_tokens += usage.get("completion_tokens", 0)

    def summary(self) -> str:
        secs = max(time.perf_counter() - self.started, 1e-9)
        valid = f"{100.0 * self.ok / self.rows:.1f}%" if self.rows else "n/a"
        lines = [
            f"rows: {self.rows} written ({self.ok} ok, {self.failed} failed, {self.truncated} truncated)"
            + (f", {self.skipped} already done" if self.skipped else ""),
            f"valid rate: {valid}",
            f"throughput: {self.rows / secs:.2f} rows/s, {self.completion_tokens / secs:.1f} generated tokens/s "
            f"in {secs:.1f}s",
            f"tokens: {self.prompt_tokens} prompt ({self.cached_tokens} from prefix cache), "
            f"{self.completion_tokens} generated",
        ]
        return "\n".join(lines)


def run_extract(
    engine: Any,
    items: Iterable[InputItem],
    write: Callable[[dict[str, Any]], None],
    params: Any,
    spec: Mapping[str, Any],
    *,
    json_output: bool,
    stats: JobStats | None = None,
    on_row: Callable[[dict[str, Any], JobStats], None] | None = None,
    max_in_flight: int = 256,
    spans: bool = False,
) -> JobStats:
    """Run the items through ``engine.generate_iter`` and write one row per item, in order.

    Items that failed before the model (bad JSON, missing field) never reach the engine;
    they wait in ``pending`` and are written when every earlier item's row is out, so the
    output keeps input order. ``generate_iter`` pulls items lazily, and an item is always
    appended to ``pending`` before the engine sees it, so when the engine yields the k-th
    result the k-th model item is already queued.
    """
    stats = stats or JobStats()
    pending: deque[InputItem] = deque()

    def prompts() -> Iterator[list[dict[str, str]]]:
        for item in items:
            pending.append(item)
            if item.error is None:
                yield item.messages  # type: ignore[misc]

    def emit(row: dict[str, Any]) -> None:
        write(row)
        stats.add(row)
        if on_row is not None:
            on_row(row, stats)

    def flush_errors() -> None:
        while pending and pending[0].error is not None:
            item = pending.popleft()
            emit({**item.row_head(), "error": item.error})

    results = engine.generate_iter(prompts(), params, chat=True, max_in_flight=max_in_flight, **spec)
    for result in results:
        flush_errors()
        item = pending.popleft()
        emit(
            {
                **item.row_head(),
                **result_row(
                    item.id,
                    result,
                    json_output=json_output,
                    max_tokens=getattr(params, "max_tokens", None),
                    spans=spans,
                ),
            }
        )
    flush_errors()
    if pending:  # the engine returned fewer results than it was given prompts
        raise RuntimeError(f"engine returned no result for {len(pending)} input rows")
    return stats
