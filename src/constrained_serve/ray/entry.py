"""``constrained_serve.ray.extract``: the Python entry point of the Ray job.

The same job as ``constrained-serve extract --ray``: a JSONL path in, rows appended to
``output`` (resumable), a summary back. Or, for users who chain it into their own pipeline,
a ``ray.data.Dataset`` in and/or out (no ``output``): the returned Dataset is lazy, has one
row per input row with the columns of ``replica.OUTPUT_COLUMNS`` (``row`` is the output line
the CLI would write, as JSON text) and runs on the caller's Ray session.
"""

from __future__ import annotations

import os
from typing import Any

from ..extract.inputs import PromptBuilder, parse_record, read_items
from ..extract.output import open_sinks
from .availability import require_ray
from .pipeline import RayOptions, items_dataset, map_rows, plan_pool, run_job
from .replica import ReplicaConfig, item_record
from .session import init
from .stats import RayJobStats


def extract(
    source: str | os.PathLike | Any,
    output: str | os.PathLike | None = None,
    *,
    errors: str | None = None,
    schema: Any = None,
    regex: str | None = None,
    grammar: str | None = None,
    grammar_syntax: str = "lark",
    grammar_backend: str = "llguidance",
    field: str = "text",
    template: str | None = None,
    instructions: str | None = None,
    id_field: str = "id",
    params: Any = None,
    model: str | None = None,
    engine_kwargs: dict[str, Any] | None = None,
    address: str | None = None,
    replicas: int | None = None,
    gpus_per_replica: float | None = None,
    cpus_per_replica: float | None = None,
    batch_size: int | None = None,
    ordered: bool = True,
    max_batch_retries: int = 3,
    replica_start_timeout_s: float = 1800.0,
) -> RayJobStats | Any:
    """Run the extraction over ``source`` (a JSONL path or a Ray Dataset of records) on Ray.

    With ``output``: rows are appended there (rows already in it are skipped, so rerunning
    resumes), and the summary (``RayJobStats``) is returned. Without: a lazy Dataset of
    rows. ``schema`` / ``regex`` / ``grammar``: the output constraint, as for
    ``Engine.generate`` (none: any JSON object). ``params``: SamplingParams (default:
    greedy, 256 tokens). ``engine_kwargs``: more Engine arguments (dtype, max_num_seqs, ...).
    ``replica_start_timeout_s``: how long the first batch waits for every replica to load its
    model (when they all fit the cluster); after it, batches go to the replicas that are up.
    """
    ray = require_ray()
    from ..params import SamplingParams

    spec, json_output = _spec(schema, regex, grammar, grammar_syntax, grammar_backend)
    builder = PromptBuilder(field=field, template=template, instructions=instructions)
    config = ReplicaConfig(
        engine_kwargs={"model": model, "grammar_backend": grammar_backend, **(engine_kwargs or {})},
        params=params if params is not None else SamplingParams(max_tokens=256),
        spec=spec,
        json_output=json_output,
    )
    options = RayOptions(
        address=address,
        replicas=replicas,
        gpus_per_replica=gpus_per_replica,
        cpus_per_replica=cpus_per_replica,
        batch_size=batch_size,
        ordered=ordered,
        max_batch_retries=max_batch_retries,
        replica_start_timeout_s=replica_start_timeout_s,
    )
    is_path = isinstance(source, (str, os.PathLike))
    if output is None:
        if not ray.is_initialized():
            init(ray, address)  # the caller's session from now on
        if not is_path:
            plan = plan_pool(ray.cluster_resources(), options, batch_size or 256)
            return map_rows(ray, _dataset_items(source, builder, id_field), config, plan, options)
        records = _path_records(os.fspath(source), builder, id_field)
        plan = plan_pool(ray.cluster_resources(), options, len(records))
        return map_rows(ray, items_dataset(ray, records, plan.batch_size), config, plan, options)
    if not is_path:
        return _dataset_to_file(ray, source, os.fspath(output), errors, builder, id_field, config, options)
    sinks = open_sinks(os.fspath(output), errors, input_path=os.fspath(source))
    try:
        stats = RayJobStats()
        with open(source, "rb") as f:
            items = read_items(
                f,
                builder,
                id_field=id_field,
                done=sinks.done,
                on_skip=lambda _item: setattr(stats, "skipped", stats.skipped + 1),
            )
            return run_job(items, sinks.write, config, options, stats=stats)
    finally:
        sinks.close()


def _spec(
    schema: Any, regex: str | None, grammar: str | None, syntax: str, backend: str
) -> tuple[dict[str, Any], bool]:
    given = [name for name, v in (("schema", schema), ("regex", regex), ("grammar", grammar)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"give only one of {', '.join(given)}")
    if regex is not None:
        return {"regex": regex, "grammar_backend": backend}, False
    if grammar is not None:
        return {"grammar": grammar, "grammar_syntax": syntax, "grammar_backend": backend}, False
    return {"schema": schema if schema is not None else {"type": "object"}, "grammar_backend": backend}, True


def _path_records(path: str, builder: PromptBuilder, id_field: str) -> list[dict[str, Any]]:
    with open(path, "rb") as f:
        return [item_record(item, seq) for seq, item in enumerate(read_items(f, builder, id_field=id_field))]


def _dataset_items(ds: Any, builder: PromptBuilder, id_field: str, done: frozenset[str] = frozenset()) -> Any:
    """A Dataset of records -> a Dataset of items, less those whose key is in ``done``. Its
    rows have no line numbers: each needs its own id in ``id_field`` (a row without one gets
    an invalid_id error row)."""

    def prepare(batch: Any) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {"seq": [], "key": [], "item": []}
        for record in batch.to_pylist():
            item = parse_record(record, 0, builder, id_field)
            if item.by_line:  # no id: the line number 0 would be every such row's key
                item = type(item)(
                    0, None, error={"type": "invalid_id", "message": f"a Dataset row needs its own {id_field!r}"}
                )
            if item.key in done:
                continue
            rec = item_record(item, -1)
            for k in out:
                out[k].append(rec[k])
        return out

    # No CPU reserved: CPU replicas hold all of a machine's CPUs, and a task waiting for one
    # would wait forever. It is JSON work of microseconds per row.
    return ds.map_batches(prepare, batch_format="pyarrow", num_cpus=0)


def _dataset_to_file(
    ray: Any,
    ds: Any,
    output: str,
    errors: str | None,
    builder: PromptBuilder,
    id_field: str,
    config: ReplicaConfig,
    options: RayOptions,
) -> RayJobStats:
    """A Dataset in, rows appended to a file: keys already written are filtered out first."""
    import json

    sinks = open_sinks(output, errors)
    stats = RayJobStats()
    try:
        items = _dataset_items(ds, builder, id_field, frozenset(sinks.done))
        plan = plan_pool(ray.cluster_resources(), options, options.batch_size or 256)
        written: set[str] = set()
        for batch in map_rows(ray, items, config, plan, options).iter_batches(batch_size=None, batch_format="numpy"):
            for key, text, replica, started, finished in zip(
                batch["key"], batch["row"], batch["replica"], batch["started"], batch["finished"]
            ):
                if key in written:  # a retried batch delivered twice
                    continue
                written.add(key)
                row = json.loads(text)
                sinks.write(row)
                stats.add_replica_row(row, str(replica), float(started), float(finished))
        return stats
    finally:
        sinks.close()
