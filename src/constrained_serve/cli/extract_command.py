"""``constrained-serve extract``: the resumable JSONL job (extract/job.py) from the command
line, locally or on a Ray cluster (``--ray``, constrained_serve/ray)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import sys
from typing import Any

from ..engine.interrupts import interrupt_at_first_press
from .engine_setup import (
    compile_before_load,
    engine_kwargs,
    is_grammar_error,
    load_engine,
    output_spec,
    sampling_params,
)
from .progress import ExtractProgress
from .ray_terminal import native_logs_filtered, no_color_reset_at_exit, quiet_ray_loggers
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
    from ..extract.inputs import PromptBuilder
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

    job = _Job(args, sinks, builder, spec, params)
    try:
        # Ctrl-C stops at once, even mid-step: every finished row is written already, and
        # the state of an engine loaded for this job does not matter once it stops
        # (interrupts.py). An Engine passed in (a notebook's) keeps the step-end wait.
        owned = args.engine is None
        with interrupt_at_first_press() if owned else contextlib.nullcontext():
            if ray_options is not None:
                job.on_ray(source, ray_options)
            else:
                job.local(source)
    except KeyboardInterrupt:
        job.close()
        print(f"constrained-serve: interrupted. {job.interrupted_message()}", file=sys.stderr)
        return 130
    finally:
        job.close()
        if source is not sys.stdin.buffer:
            source.close()
    if not args.quiet:
        where = args.output + (f" (error rows: {args.errors})" if args.errors else "")
        print(f"{job.stats.summary()}\noutput: {where}", file=sys.stderr)
    return 0


class _Job:
    """One run of the extract command: its output files, counters and progress line."""

    def __init__(self, args: argparse.Namespace, sinks: Any, builder: Any, spec: OutputSpecArgs, params: Any):
        from ..extract.job import JobStats

        self.args, self.sinks, self.builder, self.spec, self.params = args, sinks, builder, spec, params
        self.stats: Any = JobStats()
        self.show_progress = not args.quiet and sys.stderr.isatty()
        self.progress: ExtractProgress | None = None
        self._closed = False

    def items(self, source: Any) -> Any:
        from ..extract.inputs import read_items

        def on_skip(_item: Any) -> None:
            self.stats.skipped += 1

        return read_items(source, self.builder, id_field=self.args.id_field, done=self.sinks.done, on_skip=on_skip)

    def on_row(self, row: dict[str, Any], _stats: Any) -> None:
        if self.progress is not None:
            self.progress.row(row)

    def start_progress(self, activity: Any = None) -> None:
        from ..extract.inputs import count_rows

        if not self.show_progress:
            return
        total = count_rows(self.args.input) if self.args.input != "-" else None
        done = len(self.sinks.done)
        left = max(total - done, 0) if total is not None else None
        self.progress = ExtractProgress(left, done, self.args.max_tokens, activity)

    def setup_failed(self) -> None:
        """Nothing ran: no empty output file is left behind."""
        self.close()
        self.sinks.remove_if_unused()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.progress is not None:
            self.progress.close()
        self.sinks.close()

    def interrupted_message(self) -> str:
        """What was kept, and the command that resumes (the one just run)."""
        import shlex

        sinks = self.sinks
        kept = self.stats.rows + sinks.out.rows_before + (sinks.errors.rows_before if sinks.errors else 0)
        command = shlex.join(["constrained-serve"] + list(getattr(self.args, "argv", None) or sys.argv[1:]))
        return (
            f"{self.stats.rows} rows written in this run ({kept} in all) are kept; "
            f"to resume, rerun the same command (rows already written are skipped):\n  {command}"
        )

    # -- locally -----------------------------------------------------------------------------
    def local(self, source: Any) -> None:
        from ..extract.job import run_extract

        args, spec = self.args, self.spec
        try:
            compile_before_load(args, spec)
            engine = load_engine(args)
        except BaseException:
            self.setup_failed()  # no empty output file left behind by a failed set-up
            raise
        driver = getattr(engine, "driver", None)
        self.start_progress(driver.activity if driver is not None else None)
        try:
            run_extract(
                engine,
                self.items(source),
                self.sinks.write,
                self.params,
                spec.kwargs,
                json_output=spec.json_output,
                stats=self.stats,
                on_row=self.on_row,
                max_in_flight=args.max_in_flight,
                spans=args.spans,
            )
        except Exception as e:
            if is_grammar_error(e) and self.stats.rows == 0:
                self.setup_failed()
                raise SetupError(f"{spec.label}: {e}") from None
            raise

    # -- on Ray --------------------------------------------------------------------------
    def on_ray(self, source: Any, options: Any) -> None:
        """The same items and sinks, an actor pool instead of the engine."""
        try:
            with native_logs_filtered(enabled=not self.args.verbose):
                self._on_ray(source, options)
        finally:
            no_color_reset_at_exit()

    def _on_ray(self, source: Any, options: Any) -> None:
        from ..ray.pipeline import run_job
        from ..ray.progress_board import BoardActivity
        from ..ray.replica import ReplicaConfig
        from ..ray.replica_pool import ReplicaStartError
        from ..ray.session import RaySetupError, check_address
        from ..ray.stats import RayJobStats

        args, spec = self.args, self.spec
        try:
            check_address(options.address)  # no cluster there: fail in a second, before the tokenizer loads
        except RaySetupError as e:
            self.setup_failed()
            raise SetupError(_address_problem(args, e)) from None
        # The spec compiles here while the cluster starts the replicas (their imports and
        # model loads take seconds): on 2 cores, in turn, it was 1-2 s of a 17 s job. A spec
        # the backend refuses still fails the job before any row is written (write waits).
        compiling = _in_thread(compile_before_load, args, spec)

        def write(row: dict[str, Any]) -> None:
            compiling.result()
            self.sinks.write(row)

        config = ReplicaConfig(engine_kwargs(args), self.params, spec.kwargs, spec.json_output)
        self.stats = RayJobStats(skipped=self.stats.skipped)
        # The replicas' rows in flight and tokens, from a board the job creates only for a
        # progress line (a terminal, not --quiet): the line moves while batches decode.
        activity = BoardActivity() if self.show_progress else None
        self.start_progress(activity)
        try:
            run_job(self.items(source), write, config, options, stats=self.stats, on_row=self.on_row, activity=activity)
            compiling.result()  # also when no row was left to run
        # RaySetupError: found, answering, yet refused (auth); ReplicaStartError: the model
        # does not load in any replica. Nothing ran: set-up errors, as locally.
        except (RaySetupError, ReplicaStartError, SetupError) as e:
            if self.stats.rows:
                raise
            self.setup_failed()
            if not isinstance(e, SetupError):
                e = SetupError(_address_problem(args, e) if isinstance(e, RaySetupError) else str(e))
            raise e from None


def _in_thread(fn: Any, *args: Any) -> Any:
    """fn(*args) started on a thread of its own; its Future."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=getattr(fn, "__name__", "task"))
    try:
        return pool.submit(fn, *args)
    finally:
        pool.shutdown(wait=False)


def _address_problem(args: argparse.Namespace, e: Exception) -> str:
    """A RaySetupError's message, naming where the address came from (our flag, or $RAY_ADDRESS)."""
    if args.ray_address:
        return f"--ray-address {args.ray_address}: {e}"
    if os.environ.get("RAY_ADDRESS"):
        return f"$RAY_ADDRESS={os.environ['RAY_ADDRESS']}: {e}"
    return str(e)


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

    quiet_ray_loggers(args.verbose)
    try:
        return RayOptions(
            address=args.ray_address,
            replicas=args.replicas,
            gpus_per_replica=args.gpus_per_replica,
            batch_size=args.batch_size,
            log_to_driver=args.verbose,
        )
    except ValueError as e:
        raise SetupError(str(e).replace("_", "-")) from None


def _unescape(text: str) -> str:
    """\\n, \\t and \\\\ as typed in a shell's double quotes, read as newline, tab, backslash."""
    return re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m.group(1)], text)
