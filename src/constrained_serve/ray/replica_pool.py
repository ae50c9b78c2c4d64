"""The replicas of a file job as Ray actors: batches out, one at a time per replica, rows back.

A file job (``extract --ray``, ``extract(path, output)``) has its items in a list on the
driver already (job.read_items), so it needs no Dataset: each replica is a Ray actor running
``ExtractReplica``, and this loop hands every actor one batch at a time and collects what
they return. Ray Data (``map_batches`` over an actor pool, what this replaced for file jobs)
cost a 72-row CPU job seconds it did not use: ``import ray.data`` (pandas, pyarrow: 0.7-1.5 s),
``from_items`` (~1 s), its executor start, and ~9% of a core while the job ran (a 0.1 s
scheduling loop in the driver, a stats actor, a location tracker and an autoscaling
coordinator), which on 2 cores stalls a 2-thread forward at every barrier. Dataset jobs keep
Ray Data (pipeline.map_rows): there the input is a Dataset.

Order: ``ordered`` yields batches in input order (a batch that finished early waits for the
ones before it), else as they finish. Faults: a replica whose process dies is restarted by
Ray (``max_restarts=-1``) and its batch retried (``max_task_retries``); a batch that fails
every retry yields nothing (the driver writes its rows as ``replica_failed`` error rows).
"""

from __future__ import annotations

import logging
import re
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .replica import ExtractReplica, ReplicaConfig

logger = logging.getLogger(__name__)

# ray.wait's timeout in the loop: a Ctrl-C (KeyboardInterrupt) is seen within this.
POLL_S = 0.5


class ReplicaStartError(RuntimeError):
    """No replica of the job could start (its constructor raised: a model that does not
    load, a bad engine argument): nothing ran."""


@dataclass(frozen=True)
class PoolShape:
    """What pipeline.Plan decided, as far as the actors go."""

    replicas: int
    num_cpus: float
    num_gpus: float
    # Every replica fits the cluster as it is: no batch goes out before all are up (else the
    # replica whose model loads first takes the first batches, and with small batches the
    # next ones too). Else batches go to the replicas that start, as they start.
    wait_for_all: bool
    start_timeout_s: float  # after this, batches go to the replicas that are up
    max_batch_retries: int


def replica_batches(
    ray: Any, batches: list[list[str]], config: ReplicaConfig, shape: PoolShape, ordered: bool = True
) -> Iterator[dict[str, list[Any]] | None]:
    """Run every batch (a list of ``item_text`` texts) on a replica; yield what the replica
    returned (``replica.OUTPUT_COLUMNS``), or None for a batch that failed every retry. The
    actors are killed when the generator ends (done, Ctrl-C, an error, or closed early)."""
    resources = {"num_gpus": shape.num_gpus} if shape.num_gpus else {}
    actor_class = ray.remote(ExtractReplica).options(
        num_cpus=shape.num_cpus,
        max_restarts=-1,
        max_task_retries=shape.max_batch_retries,
        **resources,
    )
    actors = [actor_class.remote(config) for _ in range(shape.replicas)]
    try:
        yield from run_batches(ray, actors, batches, shape, ordered)
    finally:
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as e:  # noqa: BLE001 - gone already; never hide the job's end for it
                logger.debug("replica kill failed: %s: %s", type(e).__name__, e)


def run_batches(
    ray: Any, actors: list[Any], batches: list[list[str]], shape: PoolShape, ordered: bool
) -> Iterator[dict[str, list[Any]] | None]:
    """The hand-out loop of replica_batches, on ``actors`` started already (any actor class
    with ``ready()`` and ``run(texts)``): one batch in flight per actor, which takes the next
    when it returns, so work spreads over the replicas; the caller owns the actors."""
    # No retries of ready(): it fails only when the constructor raised, and would again.
    starting = {actor.ready.options(max_task_retries=0).remote(): actor for actor in actors}
    idle: deque[Any] = deque()
    pending = deque(enumerate(batches))
    running: dict[Any, tuple[Any, int]] = {}  # task -> (actor, batch index)
    done: dict[int, dict[str, list[Any]] | None] = {}  # finished, not yet yielded (ordered)
    next_out = 0
    gate_until = time.monotonic() + shape.start_timeout_s if shape.wait_for_all else 0.0
    start_error: BaseException | None = None
    while pending or running:
        if not starting or time.monotonic() >= gate_until:  # all up, or no more waiting for them
            while idle and pending:
                actor = idle.popleft()
                index, texts = pending.popleft()
                running[actor.run.remote(texts)] = (actor, index)
        if not starting and not running:  # every replica failed to start
            raise ReplicaStartError(f"no replica could start: {failure_reason(start_error)}") from start_error
        ready, _ = ray.wait(list(starting) + list(running), num_returns=1, timeout=POLL_S)
        for ref in ready:
            if ref in starting:
                actor = starting.pop(ref)
                try:
                    logger.info("replica %s is up", ray.get(ref))
                    idle.append(actor)
                except Exception as e:  # noqa: BLE001 - its constructor failed: the others go on
                    start_error = e
                    if starting or running or idle:  # else the error below says it
                        logger.warning("a replica failed to start: %s", failure_reason(e))
                continue
            actor, index = running.pop(ref)
            try:
                result = ray.get(ref)
            except Exception as e:  # noqa: BLE001 - failed every retry: its rows become error rows
                logger.warning("a batch of %d rows failed on every retry: %s", len(batches[index]), failure_reason(e))
                result = None
            idle.append(actor)
            if not ordered:
                yield result
                continue
            done[index] = result
            while next_out in done:
                yield done.pop(next_out)
                next_out += 1


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def failure_reason(e: BaseException | None) -> str:
    """One line for a Ray error: the exception a task raised, or the last line of the
    traceback Ray sends for a constructor that raised (its error text is the whole remote
    traceback, colour codes included)."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException):  # RayTaskError: the task's own exception
        return f"{type(cause).__name__}: {cause}"
    text = _ANSI.sub("", str(getattr(e, "error_msg", None) or e))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if getattr(e, "actor_init_failed", False) and lines:
        return f"its constructor raised {lines[-1]}"
    return lines[0] if lines else type(e).__name__
