"""asyncio front of an Engine: ``await generate(...)``, ``await chat(...)``, ``async for`` in
``stream(...)``, with the sync API's arguments and Results.

Why a class of its own rather than async methods on Engine: the asyncio side needs a thread
that steps the engine while coroutines wait (a coroutine must never run a 100 ms forward on
the event loop), and that thread has a lifetime (``aclose``) a plain Engine does not need.
``AsyncEngine(**engine_kwargs)`` builds the Engine on its stepper thread (on CPU a forward
runs ~30% faster on the thread that loaded the model); ``AsyncEngine(engine)`` wraps an
existing Engine, so sync calls from other threads keep working beside it: they take the
same core lock, and every step, whoever runs it, advances every caller's requests, so async
and sync requests share batches.

The stepper thread sleeps until a coroutine submits work, steps while any watched request is
unfinished, and after each step hands each watcher its news on its event loop (text deltas
for streams, the finished requests for the rest). A cancelled coroutine (a client that went
away) has its requests aborted before the next step: their pages go back to the pool.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .call import Call, Entry
from .engine.driver import Driver, LostRequestError
from .engine.request import Request
from .errors import OutputError
from .params import SamplingParams
from .result import Result
from .streaming import PartialStream, TextDeltas, check_not_aborted

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from .api import Engine

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "Stream"]


@dataclass(eq=False)
class _Watch:
    """Requests a coroutine waits on, and how to tell it (called on the stepper thread,
    under the core lock; the callbacks hop to the coroutine's loop themselves)."""

    requests: list[Request]
    on_step: Callable[[], None] | None = None  # after every step (streams)
    on_done: Callable[[BaseException | None], None] | None = None  # once, when all have finished
    done: bool = field(default=False)

    def finish(self, error: BaseException | None) -> None:
        if not self.done:
            self.done = True
            if self.on_done is not None:
                self.on_done(error)


class _Stepper:
    """The thread that steps the engine for the coroutines, through the engine's driver.
    Given a factory, it builds the engine itself: on CPU, torch's OpenMP runtime throttles
    its spin-waits once a second thread runs parallel regions, and a forward then runs ~30%
    slower (12.9 s against 16.7 s for 64 chats on the 2-core VM) than on the thread that
    loaded the model."""

    engine: Engine
    driver: Driver  # the engine's: it adds, steps and aborts

    def __init__(self, engine: Engine | None = None, factory: Callable[[], Engine] | None = None) -> None:
        if engine is not None:
            self.engine, self.driver = engine, engine.driver
        self._cv = threading.Condition()
        self._watches: list[_Watch] = []
        self._aborts: list[Request] = []
        self._closed = False
        self._ready = threading.Event()
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._main, args=(factory,), name="async-engine-stepper", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failed is not None:
            raise self._failed

    def _main(self, factory: Callable[[], Engine] | None) -> None:
        try:
            if factory is not None:
                engine = factory()
                self.engine, self.driver = engine, engine.driver
        except BaseException as e:  # noqa: BLE001 - raised in the constructor's thread
            self._failed = e
            return
        finally:
            self._ready.set()
        self._run()

    def submit(self, watch: _Watch) -> None:
        """Add the watch's requests to the engine and wake the thread."""
        self.driver.add(watch.requests)
        with self._cv:
            if self._closed:
                raise RuntimeError("this AsyncEngine is closed")
            self._watches.append(watch)
            self._cv.notify()

    def cancel(self, requests: Sequence[Request]) -> None:
        """Abort these before the next step (never blocks: the caller may be an event loop)."""
        with self._cv:
            self._aborts.extend(requests)
            self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        driver = self.driver
        while True:
            with self._cv:
                while not self._closed and not self._watches and not self._aborts:
                    self._cv.wait()
                if self._closed:
                    watches, self._watches = self._watches, []
                    for w in watches:
                        w.finish(RuntimeError("the AsyncEngine was closed"))
                    return
                watches, aborts, self._aborts = list(self._watches), self._aborts, []
            error: BaseException | None = None
            stepped = False
            with driver.lock:
                driver.abort(aborts)
                try:
                    stepped = driver.step_for([r for w in watches for r in w.requests])
                except LostRequestError as e:
                    error = e
                except Exception as e:  # noqa: BLE001 - every waiter hears of it
                    logger.exception("engine step failed")
                    error = e
                for w in watches:
                    if w.on_step is not None:
                        w.on_step()
                    if error is not None or all(r.finished for r in w.requests):
                        w.finish(error)
            with self._cv:
                self._watches = [w for w in self._watches if not w.done]
                if not stepped and self._watches and not self._aborts:
                    # Nothing ran (every request still waits for its grammar to compile):
                    # look again shortly instead of spinning.
                    self._cv.wait(0.005)


def _on_loop(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
    """Run fn(*args) on loop from another thread (a loop already closed: nobody waits)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


async def _text_deltas(stepper: _Stepper, r: Request) -> AsyncIterator[str]:
    """r's text deltas as the stepper thread decodes it (r not added yet: it is added here);
    a failure midway raises OutputError after its text. Stopping early cancels r."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    deltas = TextDeltas(r)

    def on_step() -> None:  # stepper thread, core lock held
        delta, _ = deltas.take()
        if delta:
            _on_loop(loop, queue.put_nowait, delta)

    def on_done(error: BaseException | None) -> None:
        _on_loop(loop, queue.put_nowait, error if error is not None else _END)

    stepper.submit(_Watch([r], on_step=on_step, on_done=on_done))
    try:
        while True:
            item = await queue.get()
            if item is _END:
                break
            if isinstance(item, BaseException):
                raise item
            yield item
        check_not_aborted(r)
    finally:
        if not r.finished:
            stepper.cancel([r])


class AsyncEngine:
    """``AsyncEngine()`` builds an Engine with the same arguments as ``Engine(...)``;
    ``AsyncEngine(engine)`` wraps one. Close it with ``await aclose()`` (or ``async with``)."""

    def __init__(self, engine: Engine | None = None, **engine_kwargs: Any) -> None:
        if engine is not None and engine_kwargs:
            raise TypeError("pass an Engine or the arguments to build one, not both")
        if engine is None:
            from .api import Engine

            # Built on the stepper thread, which runs every forward (see _Stepper).
            self._stepper = _Stepper(factory=lambda: Engine(**engine_kwargs))
        else:
            self._stepper = _Stepper(engine)
        self.engine: Engine = self._stepper.engine

    @classmethod
    def from_factory(cls, factory: Callable[[], Engine]) -> AsyncEngine:
        """An AsyncEngine over the Engine ``factory()`` builds, called on the stepper thread."""
        self = cls.__new__(cls)
        self._stepper = _Stepper(factory=factory)
        self.engine = self._stepper.engine
        return self

    # ------------------------------------------------------------------ what a server shows
    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The engine's tokenizer (a server decodes logprob tokens with it)."""
        return self.engine.tokenizer

    @property
    def model_path(self) -> str | None:
        """Where the engine's model was loaded from (a folder or a GGUF file), as a string."""
        path = self.engine.model_path
        return str(path) if path is not None else None

    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await asyncio.to_thread(self._stepper.close)

    # ------------------------------------------------------------------ calls
    async def generate(
        self,
        prompts: str | Sequence[Any],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        raise_on_error: bool = False,
        **spec_kwargs: Any,
    ) -> list[Result]:
        """As ``Engine.generate``: raw prompts, one Result per prompt, in input order."""
        return await self._run(Call.of(prompts, params, False, spec_kwargs, raise_on_error=raise_on_error))

    async def chat(
        self,
        messages: Any,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        raise_on_error: bool = False,
        **spec_kwargs: Any,
    ) -> list[Result]:
        """As ``Engine.chat``: message lists through the chat template (with ``tools``, as there)."""
        from .api import _with_tools

        spec_kwargs = _with_tools(spec_kwargs, tools, tool_choice, parallel_tool_calls)
        return await self._run(Call.of(messages, params, True, spec_kwargs, raise_on_error=raise_on_error))

    async def _run(self, call: Call) -> list[Result]:
        # Tokenizing and compiling take milliseconds to seconds: not on the event loop.
        entries = await asyncio.to_thread(self._entries, call)
        requests = [r for e in entries for r in e.requests]
        if requests:
            loop = asyncio.get_running_loop()
            done: asyncio.Future = loop.create_future()

            def finished(error: BaseException | None) -> None:
                _on_loop(loop, _settle, done, error)

            self._stepper.submit(_Watch(requests, on_done=finished))
            try:
                await done
            except asyncio.CancelledError:
                self._stepper.cancel(requests)
                raise
        return [self.engine.result_of(e, call.raise_on_error) for e in entries]

    def _entries(self, call: Call) -> list[Entry]:
        return list(self.engine.entries(call))

    async def stream(
        self, prompt: Any, params: SamplingParams | None = None, *, partial: bool = False, **spec_kwargs: Any
    ) -> AsyncIterator[Any]:
        """As ``Engine.stream``: text deltas as they are decoded; a request that fails midway
        raises OutputError after its text. Stop iterating (or cancel) to abort it. With
        ``partial=True`` (a JSON spec): partial objects, then the validated one (partial.py)."""
        s = await self.open_stream(prompt, params, **spec_kwargs)
        if not partial:
            async for delta in s.deltas():
                yield delta
            return
        objects = PartialStream(s.request)  # raises before the request is added
        async for delta in s.deltas():
            obj = objects.feed(delta)
            if obj is not None:
                yield obj
        yield objects.final(s.result())

    async def open_stream(self, prompt: Any, params: SamplingParams | None = None, **spec_kwargs: Any) -> Stream:
        """A stream whose bad input has already raised (a server answers 400 before its first
        byte); iterate ``stream.events()`` for ``(delta, None)`` while it decodes, then
        ``("", result)``. Its request decodes once iterated."""
        call = Call.stream(prompt, params, spec_kwargs)
        [entry] = await asyncio.to_thread(self._entries, call)
        return Stream(self._stepper, self.engine, entry)


class Stream:
    """A request opened by ``AsyncEngine.open_stream``, not yet decoding."""

    def __init__(self, stepper: _Stepper, engine: Engine, entry: Entry) -> None:
        self._stepper, self._engine, self._entry = stepper, engine, entry
        [self.request] = entry.requests

    def deltas(self) -> AsyncIterator[str]:
        """The text deltas as the request decodes; a failure midway raises OutputError after its text."""
        return _text_deltas(self._stepper, self.request)

    def result(self) -> Result:
        """The Result of the finished request."""
        return self._engine.result_of(self._entry)

    async def events(self) -> AsyncIterator[tuple[str, Result | None]]:
        try:
            async for delta in self.deltas():
                yield delta, None
        except OutputError:
            pass  # the Result says why
        yield "", self.result()


_END = object()


def _settle(fut: asyncio.Future, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)
