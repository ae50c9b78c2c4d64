"""``constrained-serve extract``: the resumable JSONL job (extract/job.py) from the command
line, locally or on a Ray cluster (``--ray``, constrained_serve/ray)."""

from __future__ import annotations

import argparse
import logging
import re
import sys
from typing import Any

from .engine_setup import (
    compile_before_load,
    engine_kwargs,
    is_grammar_error,
    load_engine,
    output_spec,
    sampling_params,
)
from .specs import OutputSpecArgs, SetupError, default_instructions

logger = logging.getLogger("constrained_serve.cli")


def _open_input(path: str) -> Any:
    if path == "-":
        return sys.stdin.buffer
    try:
        return open(path, "rb")
    except OSError as e:
        raise SetupError(f"cannot read input {path}: {e.strerror or e}") from None


def cmd_extract(args: argparse.Namespace) -> int:
    from ..extract.job import JobStats, PromptBuilder, count_rows, read_items, run_extract
    from ..extract.output import OutputFileError, open_sinks

    if args.max_in_flight < 1:
        raise SetupError("--max-in-flight must be at least 1")
    ray_options = _ray_options(args)  # before anything else: no Ray installed fails at once
    if ray_options is not None and args.spans:
        raise SetupError("--spans is not available with --ray yet: run the job locally for the spans column")
    source = _open_input(args.input)  # before the slow parts: fail fast on a typo
    spec = output_spec(args, default_any_json=True)
    instructions = args.instructions if args.instructions is not None else default_instructions(spec)
    try:
        template = None if args.template is None else _unescape(args.template)
        builder = PromptBuilder(field=args.field, template=template, instructions=instructions)
    except ValueError as e:
        raise SetupError(str(e)) from None
    params = sampling_params(args)
    try:
        sinks = open_sinks(args.output, args.errors, input_path=args.input)
    except (OutputFileError, OSError) as e:
        raise SetupError(str(e)) from None

    try:
        show_progress = not args.quiet and sys.stderr.isatty()
        total = count_rows(args.input) if show_progress and args.input != "-" else None
        if ray_options is not None:
            return _extract_on_ray(args, ray_options, source, builder, spec, params, sinks, show_progress)
        try:
            compile_before_load(args, spec)
            engine = load_engine(args)
        except BaseException:
            sinks.remove_if_unused()  # no empty output file left behind by a failed set-up
            raise
        stats = JobStats()
        bar = _progress_bar(total, len(sinks.done)) if show_progress else None

        def on_skip(_item: Any) -> None:
            stats.skipped += 1

        def on_row(row: dict[str, Any], st: JobStats) -> None:
            if bar is not None:
                bar.update(1)
                secs = max(bar.format_dict.get("elapsed", 0.0), 1e-9)
                bar.set_postfix(
                    tok_s=f"{st.completion_tokens / secs:.0f}", errors=st.failed + st.truncated, refresh=False
                )

        items = read_items(source, builder, id_field=args.id_field, done=sinks.done, on_skip=on_skip)
        try:
            run_extract(
                engine,
                items,
                sinks.write,
                params,
                spec.kwargs,
                json_output=spec.json_output,
                stats=stats,
                on_row=on_row,
                max_in_flight=args.max_in_flight,
                spans=args.spans,
            )
        except Exception as e:
            if is_grammar_error(e) and stats.rows == 0:
                sinks.remove_if_unused()
                raise SetupError(f"{spec.label}: {e}") from None
            raise
        finally:
            if bar is not None:
                bar.close()
    finally:
        sinks.close()
        if source is not sys.stdin.buffer:
            source.close()

    if not args.quiet:
        where = args.output + (f" (error rows: {args.errors})" if args.errors else "")
        print(f"{stats.summary()}\noutput: {where}", file=sys.stderr)
    return 0


def _ray_options(args: argparse.Namespace) -> Any:
    """RayOptions for --ray (None without it); a SetupError when Ray is missing or a Ray flag
    is given without --ray."""
    ray_flags = [
        f
        for f, v in (
            ("--ray-address", args.ray_address),
            ("--replicas", args.replicas),
            ("--gpus-per-replica", args.gpus_per_replica),
            ("--batch-size", args.batch_size),
        )
        if v is not None
    ]
    if not args.ray:
        if ray_flags:
            raise SetupError(f"{', '.join(ray_flags)} only apply with --ray")
        return None
    if args.engine is not None:
        raise SetupError("--ray loads its own engines (one per replica); it cannot use an Engine passed in")
    from ..ray.availability import RayNotInstalledError, require_ray

    try:
        require_ray()
    except RayNotInstalledError as e:
        raise SetupError(str(e)) from None
    from ..ray.pipeline import RayOptions

    if not args.verbose:  # Ray Data logs each dataset's start and end at INFO
        logging.getLogger("ray.data").setLevel(logging.WARNING)

    try:
        return RayOptions(
            address=args.ray_address,
            replicas=args.replicas,
            gpus_per_replica=args.gpus_per_replica,
            batch_size=args.batch_size,
        )
    except ValueError as e:
        raise SetupError(str(e).replace("_", "-")) from None


def _extract_on_ray(
    args: argparse.Namespace,
    options: Any,
    source: Any,
    builder: Any,
    spec: OutputSpecArgs,
    params: Any,
    sinks: Any,
    show_progress: bool,
) -> int:
    """cmd_extract on a Ray cluster: the same items and sinks, an actor pool instead of the engine."""
    from ..extract.job import count_rows, read_items
    from ..ray.pipeline import run_job
    from ..ray.replica import ReplicaConfig
    from ..ray.stats import RayJobStats

    try:
        compile_before_load(args, spec)  # a spec the backend refuses fails here, not in every actor
    except BaseException:
        sinks.remove_if_unused()
        raise
    config = ReplicaConfig(engine_kwargs(args), params, spec.kwargs, spec.json_output)
    stats = RayJobStats()
    total = count_rows(args.input) if show_progress and args.input != "-" else None
    bar = _progress_bar(total, len(sinks.done)) if show_progress else None

    def on_skip(_item: Any) -> None:
        stats.skipped += 1

    def on_row(_row: dict[str, Any], st: Any) -> None:
        if bar is not None:
            bar.update(1)
            bar.set_postfix(errors=st.failed + st.truncated, refresh=False)

    items = read_items(source, builder, id_field=args.id_field, done=sinks.done, on_skip=on_skip)
    try:
        run_job(items, sinks.write, config, options, stats=stats, on_row=on_row)
    finally:
        if bar is not None:
            bar.close()
    if not args.quiet:
        where = args.output + (f" (error rows: {args.errors})" if args.errors else "")
        print(f"{stats.summary()}\noutput: {where}", file=sys.stderr)
    return 0


def _unescape(text: str) -> str:
    """\\n, \\t and \\\\ as typed in a shell's double quotes, read as newline, tab, backslash."""
    return re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m.group(1)], text)


def _progress_bar(total: int | None, initial: int) -> Any:
    import shutil

    from tqdm import tqdm

    # A terminal that reports 0 columns (some ptys) would get an empty bar: fall back to 100.
    width = shutil.get_terminal_size((100, 20)).columns or 100
    # total counts every non-blank input line; rows done by an earlier run start it off.
    start = min(initial, total) if total else 0
    return tqdm(total=total, initial=start, unit="row", ncols=width, file=sys.stderr, desc="extract")
