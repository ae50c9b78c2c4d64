"""Streaming one request, the parts ``Engine.stream`` and ``AsyncEngine.stream`` share: the
text a request shows since it was last read (``TextDeltas``), the error of a stream that
failed midway (``check_not_aborted``), and the partial objects of a JSON output
(``PartialStream``). ``stream_text`` is the sync stream: it steps the engine itself through
the driver; other callers' requests share those steps."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from .engine.request import Request
from .errors import OutputError
from .output.partial import PartialObjects, final_object

if TYPE_CHECKING:
    from .engine.driver import Driver
    from .result import Result

__all__ = ["PartialStream", "TextDeltas", "check_not_aborted", "stream_partial", "stream_text"]


class TextDeltas:
    """The text of one request as it decodes, in pieces not shown before. Read it under the
    core lock (a step may be changing the request): ``take`` once after each step."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.shown = 0  # characters of the output text already handed out

    def take(self) -> tuple[str, bool]:
        """(the text not shown yet, whether the request has finished). What this read saw: a
        step run by another caller may have finished the request, and its last text must
        still be shown."""
        r = self.request
        done = r.finished
        if done:
            r.detok.flush()
        text = r.visible_text(final=done)
        delta = text[self.shown :]
        self.shown = max(self.shown, len(text))
        return delta, done


def check_not_aborted(r: Request) -> None:
    """A finished stream that failed (``finish_reason == "abort"``: a grammar dead end, no KV
    room) raises OutputError after its text; truncation and stops end it quietly."""
    if r.finish_reason == "abort":
        raise OutputError(f"stream aborted after {r.num_output} tokens: {r.error_type}: {r.error}")


class PartialStream:
    """``partial=True``: a JSON stream's text deltas -> partial objects, one each time another
    top-level field is complete, then the validated object (see output/partial.py). Made
    before decoding: a request without a JSON spec raises ValueError here."""

    def __init__(self, request: Request) -> None:
        spec = request.spec
        if spec is None or not spec.is_json:
            raise ValueError("partial=True needs a JSON output spec (schema= or a json response_format)")
        self.spec = spec
        self.objects = PartialObjects(spec.python_type)

    def feed(self, delta: str) -> Any | None:
        """A new partial object when this delta completed another field, else None."""
        return self.objects.feed(delta)

    def final(self, result: Result) -> Any:
        """The last object: the validated one; OutputError if the output is not a complete valid one."""
        return final_object(result, self.spec)


def stream_text(driver: Driver, r: Request) -> Iterator[str]:
    """r's text deltas as it decodes (r not added yet: the first ``next()`` adds it), stepping
    the engine through ``driver``. Stopping early (or an error) aborts r."""
    driver.add([r])
    deltas = TextDeltas(r)
    try:
        while True:
            with driver.lock:  # another thread may be stepping: read the text here
                driver.step_for([r])
                delta, done = deltas.take()
            if delta:
                yield delta
            if done:
                check_not_aborted(r)
                return
    finally:
        driver.abort([r])


def stream_partial(deltas: Iterator[str], partial: PartialStream, result: Callable[[], Result]) -> Iterator[Any]:
    """The sync partial stream over ``deltas``; ``result()`` is the finished request's Result."""
    for delta in deltas:
        obj = partial.feed(delta)
        if obj is not None:
            yield obj
    yield partial.final(result())
