"""The resumable JSONL extraction job behind ``constrained-serve extract``.

Data flow (all streaming, so inputs larger than memory are fine)::

    input.jsonl --read_items() (inputs.py)--> InputItem (prompt, or an error found before the model)
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

import logging
import re
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .inputs import InputItem, error_object

logger = logging.getLogger(__name__)

# Error types of rows whose output failed (those found before the model: inputs.py).
TRUNCATED = "truncated"
INVALID_OUTPUT = "invalid_output"


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
        row_err = error_object(kind, error or "the request was aborted")
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
        return {
            "id": row_id,
            "error": {**error_object(TRUNCATED, msg), "text": text},
            "finish_reason": finish,
            "usage": usage,
        }
    if json_output and value is None:
        row_err = {**error_object(INVALID_OUTPUT, "the output did not parse as JSON"), "text": text}
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
