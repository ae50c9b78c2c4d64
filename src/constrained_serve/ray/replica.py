"""One engine replica: the class each Ray actor of a job runs (replica_pool.py for a file
job; Ray Data's actor pool, as a callable class, for a Dataset job).

Ray builds the class once per actor (``__init__`` loads the model, so the weights,
the compiled grammar and the prefix cache stay warm across every batch the actor gets)
and calls it once per batch. A batch is a slice of the job's items in input order; the
replica runs it through the same ``run_extract`` loop as the local CLI, so a row written
from Ray is the row the local job writes for the same line.

Items travel as JSON text (``item_text`` / ``record_item``, in ``item_record`` columns): rows
of different shapes (a prompt, an early error) in one Arrow column would not have one schema.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..extract.inputs import InputItem
from ..extract.job import error_type_name, run_extract
from .progress_board import REPORT_EVERY_S, ActivityReporter

logger = logging.getLogger(__name__)

# Output columns of the replica (and of the Dataset ``extract`` returns).
# started/finished: the wall-clock span (time.time(), the replica's node) of the row's batch.
KEY, ROW, OK, REPLICA, STARTED, FINISHED = "key", "row", "ok", "replica", "started", "finished"
OUTPUT_COLUMNS = (KEY, ROW, OK, REPLICA, STARTED, FINISHED)


def item_text(item: InputItem) -> str:
    """An item as the JSON text a replica reads (``record_item`` reads it back)."""
    payload = {
        "line": item.line_no,
        "id": item.id,
        "by_line": item.by_line,
        "messages": item.messages,
        "error": item.error,
    }
    return json.dumps(payload, ensure_ascii=False)


def item_record(item: InputItem, seq: int) -> dict[str, Any]:
    """An item as a Dataset row: its resume key (the driver matches rows to inputs by it),
    its position in this run's input, and the item itself as JSON text."""
    return {"seq": seq, KEY: item.key, "item": item_text(item)}


def record_item(text: str) -> InputItem:
    d = json.loads(text)
    return InputItem(d["line"], d["id"], messages=d["messages"], error=d["error"], by_line=d["by_line"])


def row_text(row: Mapping[str, Any]) -> str:
    """The output line, as ``JsonlSink.write`` would write it (a lone surrogate from an
    input's \\udXXX escape cannot be UTF-8: escape it, as the sink does)."""
    text = json.dumps(row, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(row)
    return text


@dataclass
class ReplicaConfig:
    """Everything a replica needs, pickled once into each actor's constructor."""

    engine_kwargs: dict[str, Any]
    params: Any  # SamplingParams
    spec: dict[str, Any]  # Engine spec keyword arguments (schema= / regex= / grammar=, grammar_backend=)
    json_output: bool = True
    # CPU replicas: torch threads (Ray gives each actor OMP_NUM_THREADS=its num_cpus;
    # the engine reads the thread count from the config instead, so say it here).
    num_threads: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # The job's ProgressBoard actor (progress_board.py), when the driver shows a progress
    # line: the replica reports its rows in flight and their tokens there while a batch runs.
    progress_board: Any = None
    progress_every_s: float = REPORT_EVERY_S


class ExtractReplica:
    """The Ray Data UDF: one ``Engine`` per actor, one call per batch of items."""

    def __init__(self, config: ReplicaConfig):
        from .. import Engine  # imported in the actor: the driver never loads torch for the model

        self.config = config
        kwargs = dict(config.engine_kwargs)
        if config.num_threads is not None and "num_threads" not in kwargs:
            kwargs["num_threads"] = config.num_threads
        self.name = _replica_name()
        # Rows of the running batch finished but not returned yet, and their tokens (for
        # the progress board: rows in flight are the batch's rows not yet returned).
        self._batch_rows = 0
        self._batch_tokens = 0
        # Every engine call runs on one thread, the one that loaded the model: Ray Data calls
        # the UDF from a thread pool, and the forward ran 1.5x slower on CPU there than on the
        # loading thread (oneDNN's per-thread state: 20.6 s against 13.5 s for 72 rows, the
        # same as one torch thread). Batches of one actor therefore run one after the other.
        self._engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"replica-{self.name}")
        started = time.perf_counter()
        self.engine = self._engine_thread.submit(Engine, **kwargs).result()
        logger.info(
            "replica %s: engine ready in %.1fs (%s)", self.name, time.perf_counter() - started, self.engine.device
        )

    def ready(self) -> str:
        """The replica's name, once its engine is up (replica_pool waits on it)."""
        return self.name

    def run(self, texts: list[str]) -> dict[str, list[Any]]:
        """A batch of ``item_text`` texts, as a Ray actor method (replica_pool.py)."""
        return self({"item": texts})

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, list[Any]]:
        started = time.time()
        items = [record_item(text) for text in batch["item"]]
        rows = self._engine_thread.submit(self._run_reporting, items, started).result()
        finished = time.time()
        return {
            KEY: [item.key for item in items],
            ROW: [row_text(r) for r in rows],
            OK: ["error" not in r for r in rows],
            REPLICA: [self.name] * len(rows),
            STARTED: [started] * len(rows),
            FINISHED: [finished] * len(rows),
        }

    def _run_reporting(self, items: list[InputItem], started: float) -> list[dict[str, Any]]:
        """``_run``, reporting to the job's progress board meanwhile (when there is one), on
        the batch named by its start time (the rows' STARTED column)."""
        board = self.config.progress_board
        if board is None:
            return self._run(items)
        with ActivityReporter(board, self.name, started, self.activity, self.config.progress_every_s):
            return self._run(items)

    def activity(self) -> tuple[int, int]:
        """(rows of the running batch not returned yet, their tokens so far): the engine's
        unfinished requests and the rows it finished, held until the batch ends. From any
        thread (Driver.activity reads without the lock; the counts are plain ints)."""
        in_flight, tokens = self.engine.driver.activity()
        return in_flight + self._batch_rows, tokens + self._batch_tokens

    def _run(self, items: list[InputItem]) -> list[dict[str, Any]]:
        """Rows for ``items``, in their order. An exception from the engine (not a per-row
        error Result, which run_extract already turns into an error row) fails the batch:
        the rows are then run one at a time, and a row that fails alone gets an error row,
        so one bad row never costs the batch or the job."""
        self._batch_rows = self._batch_tokens = 0
        try:
            return self._extract(items)
        except Exception as e:  # noqa: BLE001 - retried row by row below
            self._batch_rows = self._batch_tokens = 0  # its rows are recomputed below
            logger.warning(
                "replica %s: a batch of %d rows failed (%s: %s); running its rows one at a time",
                self.name,
                len(items),
                type(e).__name__,
                e,
            )
        rows = []
        for item in items:
            try:
                rows.extend(self._extract([item]))
            except Exception as e:  # noqa: BLE001 - becomes this row's error row
                logger.warning("replica %s: row %s failed: %s: %s", self.name, item.key, type(e).__name__, e)
                err = {"type": error_type_name(type(e).__name__), "message": f"{type(e).__name__}: {e}"}
                rows.append({**item.row_head(), "error": err})
        return rows

    def _extract(self, items: list[InputItem]) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        cfg = self.config

        def keep(row: dict[str, Any]) -> None:
            rows.append(row)
            self._batch_tokens += (row.get("usage") or {}).get("completion_tokens", 0)
            self._batch_rows += 1

        run_extract(
            self.engine,
            items,
            keep,
            cfg.params,
            cfg.spec,
            json_output=cfg.json_output,
            max_in_flight=max(len(items), 1),
        )
        return rows


def _replica_name() -> str:
    """A short name for the summary: the start of the actor's id (its unique part; kept across
    restarts), else the pid."""
    try:
        import ray

        actor_id = ray.get_runtime_context().get_actor_id()
    except Exception:  # noqa: BLE001 - outside an actor (a test calling the class directly)
        actor_id = None
    return actor_id[:8] if actor_id else f"pid{os.getpid()}"
