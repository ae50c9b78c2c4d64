"""Streaming one request: ``Engine.stream`` yields text deltas as tokens are decoded (or,
with ``partial=True``, partial objects of the schema as fields complete), stepping the
engine itself; other callers' requests share those steps."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .engine.request import Request
from .errors import OutputError
from .inputs import Messages
from .params import SamplingParams

if TYPE_CHECKING:
    from .engine.core import EngineCore


class EngineStreaming:
    """The streaming side of ``Engine``: what it needs of the engine is declared here."""

    core: EngineCore
    _core_lock: threading.RLock

    def stream(
        self, prompt: str | Messages, params: SamplingParams | None = None, *, partial: bool = False, **spec_kwargs: Any
    ) -> Iterator[Any]:
        """An iterator of text deltas as they are decoded (constrained or not). Bad input
        raises here, at the call; decoding starts at the first ``next()``. A request that fails
        midway (``finish_reason == "abort"``: a grammar dead end, no KV room) raises
        OutputError after the text it produced; truncation and stops end the stream quietly.

        ``partial=True`` (a JSON spec): partial objects instead of text, one each time another
        top-level field is complete, then the validated object (see partial.py); an output
        that does not complete or validate raises OutputError at the end."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"stream takes one prompt and one SamplingParams, got {type(params).__name__}")
        params.validate()
        if params.n != 1:
            raise ValueError(f"stream yields one completion: n must be 1, got {params.n}")
        backend, spec_args = self._spec_args(spec_kwargs)
        spec = self.make_spec(**spec_args)
        if spec is not None:
            self.grammar.compile(spec, backend, params.compile_timeout_s)
        ids = self.encode_prompt(prompt) if isinstance(prompt, str) else self.encode_chat(prompt)
        if partial and (spec is None or not spec.is_json):
            raise ValueError("partial=True needs a JSON output spec (schema= or a json response_format)")
        r = self._new_request(ids, params, spec, 0, backend)
        return self._partial(r, prompt) if partial else self._stream(r)

    def _partial(self, r: Request, prompt: Any) -> Iterator[Any]:
        from .output.partial import PartialObjects, final_object

        objects = PartialObjects(r.spec.python_type)
        for delta in self._stream(r):
            obj = objects.feed(delta)
            if obj is not None:
                yield obj
        yield final_object(self._hand_back(r, prompt, False), r.spec)

    def _stream(self, r: Request) -> Iterator[str]:
        with self._core_lock:
            self.core.add(r)
        shown = 0  # characters of the output text already yielded
        try:
            while True:
                with self._core_lock:  # another thread may be stepping: read the text here
                    if not r.finished:
                        self._step_for(r)
                    # What this pass saw: a step run by another call while this generator
                    # waits at its yield may finish r, and its last text must still be shown.
                    done = r.finished
                    if done:
                        r.detok.flush()
                    text = r.visible_text(final=done)
                if len(text) > shown:
                    yield text[shown:]
                    shown = len(text)
                if done:
                    if r.finish_reason == "abort":  # failed (a grammar dead end, no room): say so
                        raise OutputError(f"stream aborted after {r.num_output} tokens: {r.error_type}: {r.error}")
                    return
        finally:
            with self._core_lock:
                if not r.finished:
                    self.core.abort(r)
                self.core.drain_finished()
