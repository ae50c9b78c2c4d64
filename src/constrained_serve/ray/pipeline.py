"""The extraction job on Ray: the driver side.

Data flow of a file job (the CLI's ``--ray``, ``extract(path, output)``)::

    input.jsonl --job.read_items()--> items (driver: bad lines -> early errors, duplicate ids
        keyed by line, rows already in the output skipped: the local job's own code)
      --> batches of --batch-size item texts, in input order
      --> replica_pool.replica_batches: one ExtractReplica actor per replica [one Engine each],
          one batch at a time per actor
      --> rows back on the driver, in input order --> JsonlSink (output.py: one flushed line per row)

    replicas --rows in flight, their tokens--> ProgressBoard actor --> the driver's progress
        line (progress_board.py; only when the CLI shows one)

A Dataset job (``extract(dataset)``, or no ``output``) runs on Ray Data instead: ``map_rows``
maps the items Dataset through ``map_batches(ExtractReplica, ActorPoolStrategy(...))``.

Why the driver reads the input: line numbers, "this id was already used by line 3" and
"this key is already in the output" are facts about the whole file in order, which Ray
Data's parallel readers do not keep. Parsing is microseconds per line next to the model,
so one reader costs nothing in throughput.

Why the driver writes the output: one writer holds the file lock, and a row is written only
after a replica returned it, so a crash (of the driver, an actor or a node) loses at most
rows in flight, and the next run (same command) skips every row already written. Each key
is written once per run even if Ray re-delivers a retried batch.

Order: with ``ordered=True`` (the default) batches are handed back in input order, so the
output file is the local CLI's, row for row. ``ordered=False`` writes batches as they
finish (no waiting behind a slow batch); rows within a batch keep input order either way.

Faults: Ray restarts a dead replica actor (``max_restarts=-1``) and retries its batch
(``max_task_retries``); a batch that fails every retry is dropped and its rows get error
rows of type ``replica_failed``: one bad row cannot fail the job.
"""

from __future__ import annotations

import json
import logging
import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from ..extract.inputs import InputItem
from .progress_board import BoardActivity, job_board
from .replica import FINISHED, KEY, REPLICA, ROW, STARTED, ExtractReplica, ReplicaConfig, item_text
from .replica_pool import PoolShape, replica_batches
from .session import ray_session
from .stats import RayJobStats

logger = logging.getLogger(__name__)

REPLICA_FAILED = "replica_failed"


@dataclass
class RayOptions:
    """Where and how wide the job runs."""

    address: str | None = None  # None: $RAY_ADDRESS or a new local cluster; "auto": the running one
    replicas: int | None = None  # default: one per GPU (GPU cluster), else 1
    gpus_per_replica: float | None = None  # default: 1 on a cluster with GPUs, else 0 (CPU actors)
    cpus_per_replica: float | None = None  # CPU replicas: default, the cluster's CPUs / replicas
    batch_size: int | None = None  # rows per map_batches call; default: see batch_size_for
    ordered: bool = True
    max_batch_retries: int = 3  # retries of a batch whose actor died, before its rows become error rows
    # How long the first batch waits for every replica to load its model (see map_rows).
    replica_start_timeout_s: float = 1800.0
    # Batches Ray Data hands one actor at once (calls, and tasks queued on it: see map_rows).
    # The actor runs them one after the other (on its engine's thread), so more than one
    # only queues a batch in a busy actor while another actor idles.
    concurrent_batches: int = 1
    progress: bool = False  # Ray Data's progress bars
    log_to_driver: bool = True  # the replicas' stdout and stderr printed by the driver (ray.init)

    def __post_init__(self) -> None:
        for name in ("replicas", "batch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        for name in ("gpus_per_replica", "cpus_per_replica"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.max_batch_retries < 0 or self.concurrent_batches < 1:
            raise ValueError("max_batch_retries must be >= 0 and concurrent_batches >= 1")
        if not self.replica_start_timeout_s >= 0:
            raise ValueError(f"replica_start_timeout_s must be >= 0, got {self.replica_start_timeout_s}")


@dataclass(frozen=True)
class Plan:
    """The actor pool the options come to on this cluster."""

    replicas: int
    num_gpus: float
    num_cpus: float
    batch_size: int
    # Every replica fits the cluster as it is: the job then waits for all of them to be up
    # before the first batch goes out (map_rows). Else (more replicas than room, an
    # autoscaling cluster) batches go to the replicas that start, as they start.
    all_fit: bool = True

    @property
    def threads(self) -> int | None:
        """Torch threads of a CPU replica: the cores it reserved."""
        return None if self.num_gpus else max(1, int(self.num_cpus))


def plan_pool(resources: dict[str, float], options: RayOptions, rows: int) -> Plan:
    """Replica count and per-actor resources from the cluster's total ``resources``."""
    gpus = float(resources.get("GPU", 0))
    cpus = float(resources.get("CPU", 1))
    per_gpu = options.gpus_per_replica if options.gpus_per_replica is not None else (1.0 if gpus else 0.0)
    if per_gpu and per_gpu > gpus:
        raise ValueError(f"{per_gpu:g} GPUs per replica, but the cluster has {gpus:g}")
    replicas = options.replicas or (max(1, int(gpus // per_gpu)) if per_gpu else 1)
    if per_gpu:
        num_cpus = options.cpus_per_replica if options.cpus_per_replica is not None else 1.0
    else:
        # CPU replicas split the cores: each gets its share as torch threads (Ray would
        # give an actor 1 CPU, hence OMP_NUM_THREADS=1, a 2x slowdown on 2 cores).
        num_cpus = options.cpus_per_replica or max(1.0, float(int(cpus // replicas)))
    fits = replicas * num_cpus <= cpus and replicas * per_gpu <= gpus
    return Plan(replicas, per_gpu, num_cpus, options.batch_size or batch_size_for(rows, replicas), fits)


def batch_size_for(rows: int, replicas: int) -> int:
    """Default rows per batch: as large as it can be, up to 256, with a batch for every
    replica, and the batches of equal size. An actor runs its batches one after the other,
    each with the engine's continuous batching inside, so a large batch keeps the decode batch
    full (256 is four times the default max_num_seqs) and a small last batch would decode
    nearly empty. 72 rows on one replica took 15.6 s as one batch and 20.6 s as four."""
    batches = max(replicas, math.ceil(rows / 256))
    return max(1, math.ceil(rows / batches))


def replica_config(config: ReplicaConfig, plan: Plan) -> ReplicaConfig:
    """``config`` with the torch threads of a CPU replica (its reserved cores) unless set."""
    if config.num_threads is None and plan.threads is not None:
        return replace(config, num_threads=plan.threads)
    return config


def pool_shape(plan: Plan, options: RayOptions) -> PoolShape:
    return PoolShape(
        replicas=plan.replicas,
        num_cpus=plan.num_cpus,
        num_gpus=plan.num_gpus,
        wait_for_all=plan.all_fit,
        start_timeout_s=options.replica_start_timeout_s,
        max_batch_retries=options.max_batch_retries,
    )


# ---------------------------------------------------------------------------------------
# the pipeline


def map_rows(ray: Any, items: Any, config: ReplicaConfig, plan: Plan, options: RayOptions) -> Any:
    """items Dataset (columns seq, key, item) -> rows Dataset (replica.OUTPUT_COLUMNS), lazily:
    the Dataset jobs of entry.py (a file job runs on replica_pool instead)."""
    # Ray Data queues up to twice an actor's concurrency on it by default, and hands batches
    # to the first actor that is up: with 2 replicas and the 36 demo rows (2 batches of 18)
    # the replica that loaded its model first took both, the other none. One task in flight
    # per actor: a batch waits for a free replica, so each of the first batches goes to a
    # different one. (The next batch is not prefetched; it is a local object-store read.)
    compute = ray.data.ActorPoolStrategy(
        size=plan.replicas,
        max_concurrent_calls_per_actor=options.concurrent_batches,
        max_tasks_in_flight_per_actor=options.concurrent_batches,
    )
    resources: dict[str, Any] = {"num_gpus": plan.num_gpus} if plan.num_gpus else {"num_cpus": plan.num_cpus}
    config = replica_config(config, plan)
    with warnings.catch_warnings():
        # max_restarts / max_task_retries have no named parameter in Ray 2.60 yet; the
        # keyword form is deprecated (removal announced for 2.64), not gone.
        warnings.filterwarnings("ignore", message=".*ray_remote_args.*deprecated.*")
        rows = items.map_batches(
            ExtractReplica,
            fn_constructor_kwargs={"config": config},
            batch_size=plan.batch_size,
            batch_format="numpy",
            compute=compute,
            udf_modifying_row_count=False,
            max_restarts=-1,
            max_task_retries=options.max_batch_retries,
            **resources,
        )
    # Settings of this Dataset only (the process-wide DataContext is the caller's).
    ctx = rows.context
    ctx.execution_options.preserve_order = options.ordered
    ctx.max_errored_blocks = -1  # a batch that fails every retry: its rows get error rows (driver)
    if plan.all_fit:
        # No batch goes out before every replica is up. Else the replica whose model loaded
        # first takes the first batch, and with small batches (a tiny model, a fast GPU) the
        # next ones too, before the others are ready: every replica gets rows from the start.
        ctx.wait_for_min_actors_s = int(options.replica_start_timeout_s)
    ctx.enable_progress_bars = options.progress
    return rows


def items_dataset(ray: Any, records: list[dict[str, Any]], batch_size: int) -> Any:
    # Blocks of one batch each: a block goes to one actor whole, so blocks larger than a
    # batch would keep the other replicas idle.
    return ray.data.from_items(records, override_num_blocks=max(1, math.ceil(len(records) / batch_size)))


def run_job(
    items: Iterable[InputItem],
    write: Callable[[dict[str, Any]], None],
    config: ReplicaConfig,
    options: RayOptions,
    *,
    stats: RayJobStats | None = None,
    on_row: Callable[[dict[str, Any], RayJobStats], None] | None = None,
    activity: BoardActivity | None = None,
) -> RayJobStats:
    """Run ``items`` (from ``job.read_items``) on replica actors; ``write`` each row once.

    ``write`` is called on this (the driver's) thread, one row per item, as rows come back.
    ``activity`` (a progress line's, see progress_board.py): a ProgressBoard is created for
    the run, the replicas report to it, ``activity`` reads it; killed when the run ends.
    """
    stats = stats or RayJobStats()
    waiting: dict[str, InputItem] = {}
    texts = []  # each item as the JSON text a replica reads
    for item in items:
        waiting[item.key] = item
        texts.append(item_text(item))
    if not texts:
        return stats

    def emit(row: dict[str, Any], replica: str, started: float, finished: float) -> None:
        write(row)
        stats.add_replica_row(row, replica, started, finished)
        if on_row is not None:
            on_row(row, stats)

    with ray_session(options.address, options.log_to_driver) as ray:
        plan = plan_pool(ray.cluster_resources(), options, len(texts))
        logger.info(
            "ray: %d rows, %d replicas (%s each), batches of %d",
            len(texts),
            plan.replicas,
            f"{plan.num_gpus:g} GPU" if plan.num_gpus else f"{plan.num_cpus:g} CPU",
            plan.batch_size,
        )
        with job_board(ray, activity) as board:  # None without a progress line
            if board is not None:
                config = replace(config, progress_board=board)
            batches = [texts[i : i + plan.batch_size] for i in range(0, len(texts), plan.batch_size)]
            for batch in replica_batches(
                ray, batches, replica_config(config, plan), pool_shape(plan, options), options.ordered
            ):
                if batch is None:  # failed every retry: its rows are written as error rows below
                    continue
                for key, text, replica, started, finished in zip(
                    batch[KEY], batch[ROW], batch[REPLICA], batch[STARTED], batch[FINISHED]
                ):
                    if waiting.pop(key, None) is None:  # a retried batch delivered twice
                        logger.debug("dropping a second row for %s", key)
                        continue
                    if activity is not None:  # its batch's rows are no longer in flight
                        activity.delivered(str(replica), float(started))
                    emit(json.loads(text), str(replica), float(started), float(finished))
    if waiting and stats.rows == 0:  # nothing came back at all: a broken set-up, not bad rows
        raise RuntimeError(f"no replica returned any row ({len(waiting)} rows sent); rerun with -v for details")
    for item in waiting.values():  # written last, whatever the order
        stats.lost += 1
        msg = f"the replica running this row's batch died {options.max_batch_retries + 1} times"
        row = {**item.row_head(), "error": {"type": REPLICA_FAILED, "message": msg}}
        write(row)
        stats.add(row)
        if on_row is not None:
            on_row(row, stats)
    return stats
