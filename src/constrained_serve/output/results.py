"""Finished requests -> ``Result`` objects: text, usage, the parsed value, and why not.

A constrained output that ``max_tokens`` or a stop cut short is flagged as truncated, never
repaired; a complete one is parsed (JSON, the Pydantic type) and checked one last time
(``grammar.output_check.parse_output``). ``raise_on_error`` turns the error into an exception.
"""

from __future__ import annotations

import copy
from typing import Any

from ..engine.request import Request
from ..errors import GrammarError, OutputError, OutputValidationError
from ..result import Result, Usage


def result_of(group: list[Request], prompt: Any, raise_on_error: bool, grammar: Any, max_model_len: int) -> Result:
    """The Result of one prompt: its request, or the n requests of SamplingParams(n) (then
    the first sample's fields, all n in ``samples``, usage summed with the prompt once).
    ``grammar``: the engine's GrammarManager (None when no spec was ever compiled)."""
    samples = [_result(r, prompt, raise_on_error, grammar, max_model_len) for r in group]
    if len(samples) == 1:
        return samples[0]
    res = copy.copy(samples[0])
    res.samples = samples
    res.usage = Usage(
        prompt_tokens=samples[0].usage.prompt_tokens,
        cached_tokens=samples[0].usage.cached_tokens,
        completion_tokens=sum(s.usage.completion_tokens for s in samples),
        forced_tokens=sum(s.usage.forced_tokens for s in samples),
    )
    return res


def error_result(index: int, e: Exception, prompt: Any = None) -> Result:
    """The Result of an input that never became a request (too long, a bad per-prompt spec)."""
    return Result(
        text="",
        token_ids=[],
        finish_reason="abort",
        error=str(e),
        error_type=type(e).__name__,
        index=index,
        prompt=prompt,
    )


def _result(r: Request, prompt: Any, raise_on_error: bool, grammar: Any, max_model_len: int) -> Result:
    r.detok.flush()
    text = r.visible_text(final=True)
    res = Result(
        text=text,
        token_ids=r.output_ids,
        finish_reason=r.finish_reason or "abort",
        usage=Usage(
            prompt_tokens=r.num_prompt,
            cached_tokens=r.num_cached,
            completion_tokens=r.num_output,
            forced_tokens=r.num_forced,
        ),
        error=r.error,
        error_type=r.error_type,
        index=r.index,
        prompt=prompt,
        stop_reason=r.stop_reason,
        logprobs=r.logprobs,
        prompt_logprobs=r.prompt_logprobs,
    )
    if r.spec is not None and r.spec.grounding is not None:
        res.source_text = r.spec.grounding.text
    refused: OutputValidationError | None = None
    if r.spec is not None and res.error is None:
        if res.finish_reason == "length":
            res.error_type = "truncated"
            limit = (
                f"max_tokens={r.params.max_tokens}"
                if r.num_output >= r.params.max_tokens
                else f"the model's context length ({max_model_len} tokens, prompt included)"
            )
            if r.matcher is not None and r.matcher.can_end():  # e.g. "[a-z ]+": could go on
                res.error = (
                    f"output truncated at {limit}: the text is a complete {r.spec.kind} "
                    f"match but may be cut short; nothing was repaired"
                )
            else:
                res.error = f"output truncated at {limit} before the {r.spec.kind} was complete; nothing was repaired"
        elif (
            res.finish_reason == "stop"
            and r.stop_reason is not None
            and r.grammar is not None
            and r.grammar.compiled is not None
            and not grammar.matches(r.grammar.compiled, text)
        ):
            what = "stop string" if isinstance(r.stop_reason, str) else "stop token"
            res.error_type = "truncated"
            res.error = (
                f"output cut by {what} {r.stop_reason!r} before the {r.spec.kind} was complete; nothing was repaired"
            )
        elif res.finish_reason == "stop":
            from ..grammar.output_check import parse_output

            try:
                res.json, res.parsed = parse_output(r.spec, text)
                if r.spec.grounding is not None:
                    from ..grammar.grounding import spans_of

                    res.spans = spans_of(r.spec, res.json)
                if r.params.field_confidence and r.spec.is_json and r.logprobs is not None:
                    from .confidence import field_confidence, token_offsets

                    offsets = token_offsets(r.detok.tok, r.prompt_ids[-4:], r.output_ids)
                    res.field_confidence = field_confidence(text, offsets, r.logprobs, r.output_ids)
            except OutputValidationError as e:  # valid JSON that the Pydantic type refuses
                res.json, res.error, res.error_type = e.value, str(e), type(e).__name__
                refused = e
            except Exception as e:  # noqa: BLE001 - reported on the result, not raised mid-batch
                res.error, res.error_type = f"output does not parse: {e}", type(e).__name__
    if raise_on_error and res.error is not None:
        message = f"request {r.index}: {res.error}"
        if res.error_type == "OutputValidationError":  # catchable with its value (a retry loop)
            raise OutputValidationError(message, res.json) from (refused.__cause__ if refused else None)
        if res.error_type == "GrammarError":
            raise GrammarError(message, backend=r.matcher.backend_name if r.matcher is not None else None)
        raise OutputError(message)
    return res
