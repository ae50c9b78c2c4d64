"""Engine-level grammar service: cached, bounded, off-the-step-loop compilation, and masks.

Compilation runs on a small thread pool so the scheduler never waits for it; each compile
runs in its own daemon thread joined with a timeout, because neither engine can be
interrupted: a runaway compile is abandoned (and logged), never waited for; its thread
keeps its CPU until the engine returns, which is the price of never blocking a request.
Some specs never return (llguidance spins for ever on the Lark grammar ``start: A B``,
``A: /a+/``, ``B: /a/``), so a spec that timed out is remembered and refused at once when
submitted again: each retry would otherwise start one more thread that spins for ever.

Typical engine use::

    gm = GrammarManager(tokenizer, vocab_size=model_logits_width)
    fut = gm.compile_async(spec)                 # at submit; GrammarError via fut.result()
    matcher = gm.new_matcher(fut.result())       # when the request is scheduled
    bitmask = gm.allocate_bitmask(max_batch)     # once; rows without a grammar stay -1
    gm.fill_bitmask([(row, matcher), ...], bitmask)   # each step, while the forward runs
    matcher.accept_tokens([sampled]); matcher.forced_tokens(); matcher.is_finished()
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..errors import GrammarError
from ..params import OutputSpec
from .base import CompiledGrammar, GrammarBackend, GrammarMatcher, allocate_bitmask

logger = logging.getLogger(__name__)

__all__ = ["GrammarManager", "BACKENDS"]

BACKENDS = ("llguidance", "xgrammar")
CacheKey = tuple[str, str, str, bool, bool]
_RUNNING = object()  # no outcome yet from a compile thread


@dataclass
class _TimedOut:
    """A compile abandoned at ``compile_timeout_s``: the refusal every retry of its spec gets,
    and the thread that may still be running it."""

    error: GrammarError
    thread: threading.Thread

    def refusal(self) -> GrammarError:
        # A fresh exception per future: one shared instance would pile up tracebacks.
        return GrammarError(str(self.error), backend=self.error.backend, reason=self.error.reason)


class GrammarManager:
    def __init__(self, tokenizer: Any, vocab_size: int, default_backend: str = "llguidance",
                 max_workers: int = 2, cache_size: int = 256, eos_token_ids: Sequence[int] | None = None,
                 compile_timeout_s: float = 10.0, backend_options: dict[str, dict[str, Any]] | None = None,
                 mask_threads: int | None = None):
        if default_backend not in BACKENDS:
            raise ValueError(f"default_backend must be one of {BACKENDS}, got {default_backend!r}")
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.default_backend = default_backend
        self.eos_token_ids = list(eos_token_ids or ())
        self.cache_size = int(cache_size)
        self.compile_timeout_s = float(compile_timeout_s)
        self._max_workers = max(1, int(max_workers))
        # Threads of the backends' batched mask fill (None: max_workers). On a CPU device the
        # forward already runs on every core while masks fill: one thread avoids preempting it.
        self._mask_threads = max(1, int(mask_threads or max_workers))
        # extra constructor kwargs per backend, e.g. {"xgrammar": {"lazy_masks": False}}
        self._backend_options = {k: dict(v) for k, v in (backend_options or {}).items()}
        self._backends: dict[str, GrammarBackend] = {}
        self._cache: collections.OrderedDict[CacheKey, CompiledGrammar] = collections.OrderedDict()
        # One in-flight future per key, so concurrent requests for one spec compile it once.
        self._pending: dict[CacheKey, cf.Future] = {}
        # Specs whose compile timed out and still runs, keyed like the cache: a retry is refused
        # at once rather than starting one more thread on it. When the abandoned compile ends,
        # the entry goes; a compile that succeeded late serves the spec from the cache (a slow
        # compile on a busy machine must not make a good spec unusable for good).
        self._timed_out: collections.OrderedDict[CacheKey, _TimedOut] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._pool = cf.ThreadPoolExecutor(self._max_workers, thread_name_prefix="grammar-compile")
        # timeouts: compiles abandoned; timeout_refusals: retries of those refused without compiling
        self.stats = {"hits": 0, "misses": 0, "compiles": 0, "timeouts": 0, "timeout_refusals": 0}

    # -- backends ------------------------------------------------------------------------
    def backend(self, name: str | None = None) -> GrammarBackend:
        """The backend object (created on first use: building tokenizer tables takes ~0.5 s)."""
        name = name or self.default_backend
        with self._lock:
            b = self._backends.get(name)
            if b is None:
                b = self._backends[name] = self._make_backend(name)
            return b

    def _make_backend(self, name: str) -> GrammarBackend:
        if name == "llguidance":
            from .llguidance import LLGuidanceBackend
            return LLGuidanceBackend(self.tokenizer, self.vocab_size, self.eos_token_ids, self._mask_threads,
                                     **self._backend_options.get(name, {}))
        if name == "xgrammar":
            from .xgrammar import XGrammarBackend
            return XGrammarBackend(self.tokenizer, self.vocab_size, self.eos_token_ids, self._mask_threads,
                                   **self._backend_options.get(name, {}))
        raise GrammarError(f"unknown grammar backend {name!r}; expected one of {BACKENDS}", backend=name)

    # -- compile -------------------------------------------------------------------------
    @staticmethod
    def cache_key(spec: OutputSpec, backend: str) -> CacheKey:
        return (backend, spec.kind, spec.text, spec.whitespace, spec.strict)

    def compile_async(self, spec: OutputSpec, backend: str | None = None) -> cf.Future:
        """A future of the ``CompiledGrammar``; ``.result()`` raises GrammarError on failure."""
        name = backend or self.default_backend
        if name not in BACKENDS:
            fut: cf.Future = cf.Future()
            fut.set_exception(GrammarError(f"unknown grammar backend {name!r}; expected one of {BACKENDS}",
                                           backend=name))
            return fut
        key = self.cache_key(spec, name)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.stats["hits"] += 1
                fut = cf.Future()
                fut.set_result(hit)
                return fut
            pending = self._pending.get(key)
            if pending is not None:  # in flight: share it, even while it runs into its timeout
                self.stats["hits"] += 1
                return pending
            timed_out = self._timed_out.get(key)
            if timed_out is not None:
                self._timed_out.move_to_end(key)
                self.stats["timeout_refusals"] += 1
                fut = cf.Future()
                fut.set_exception(timed_out.refusal())
                return fut
            self.stats["misses"] += 1
            fut = self._pool.submit(self._compile_bounded, spec, name, key)
            self._pending[key] = fut
        return fut

    def compile(self, spec: OutputSpec, backend: str | None = None) -> CompiledGrammar:
        return self.compile_async(spec, backend).result()

    def _compile_bounded(self, spec: OutputSpec, name: str, key: CacheKey) -> CompiledGrammar:
        try:
            b = self.backend(name)
            box: dict[str, Any] = {}  # "done": the CompiledGrammar or the exception; under self._lock

            def work() -> None:
                t0 = time.monotonic()
                outcome: Any
                try:
                    compiled = b.compile(spec)
                    # Refused at submit like any bad spec, rather than aborting mid-batch.
                    if b.dead_end(b.new_matcher(compiled)):
                        raise GrammarError(f"{name}: the {spec.kind} spec matches no text at all "
                                           f"(nothing can be generated from its start)",
                                           backend=name, reason="matches no text")
                    outcome = compiled
                except BaseException as e:  # surfaced below, in the caller's future
                    outcome = e
                with self._lock:
                    box["done"] = outcome
                    late = self._timed_out.pop(key, None) is not None
                    if late and not isinstance(outcome, BaseException):
                        self._cache_put(key, outcome)
                if late:
                    logger.info("abandoned %s compile of a %s spec ended after %.1f s (%s)", name, spec.kind,
                                time.monotonic() - t0, "failed: a retry compiles it again"
                                if isinstance(outcome, BaseException) else "compiled: now cached")

            t = threading.Thread(target=work, name=f"grammar-compile-{name}", daemon=True)
            t.start()
            t.join(self.compile_timeout_s)
            with self._lock:  # decided under the lock, so a compile ending just now is not lost
                outcome = box.get("done", _RUNNING)
                timed_out = self._remember_timeout(key, spec, name, t) if outcome is _RUNNING else None
            if timed_out is not None:
                logger.warning("%s compile of a %s spec exceeded %.1f s; abandoned (%d abandoned compile "
                               "thread(s) still running; they cannot be stopped)", name, spec.kind,
                               self.compile_timeout_s, self.abandoned_running())
                raise timed_out.error
            if isinstance(outcome, BaseException):
                if isinstance(outcome, GrammarError):
                    raise outcome
                raise GrammarError(f"{name}: unexpected error compiling the {spec.kind} spec: {outcome!r}",
                                   backend=name, reason=str(outcome)) from outcome
            compiled: CompiledGrammar = outcome
            with self._lock:
                self._cache_put(key, compiled)
            return compiled
        finally:
            with self._lock:
                self._pending.pop(key, None)

    def _cache_put(self, key: CacheKey, compiled: CompiledGrammar) -> None:
        """Cache a finished compile, least recently used out first (caller holds the lock)."""
        self.stats["compiles"] += 1
        self._cache[key] = compiled
        self._cache.move_to_end(key)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    def _remember_timeout(self, key: CacheKey, spec: OutputSpec, name: str,
                          thread: threading.Thread) -> _TimedOut:
        """Record an abandoned compile (caller holds ``self._lock``)."""
        error = GrammarError(f"{name}: compiling the {spec.kind} spec took longer than "
                             f"{self.compile_timeout_s:g} s (abandoned; a retry of this spec is "
                             f"refused at once while that compile still runs)", backend=name, reason="timeout")
        entry = self._timed_out[key] = _TimedOut(error, thread)
        self.stats["timeouts"] += 1
        return entry

    def abandoned_running(self) -> int:
        """Abandoned compiles whose threads still run (each holds a core while it spins)."""
        with self._lock:
            return sum(v.thread.is_alive() for v in self._timed_out.values())

    # -- matchers and masks --------------------------------------------------------------
    def new_matcher(self, compiled: CompiledGrammar) -> GrammarMatcher:
        return self.backend(compiled.backend).new_matcher(compiled)

    def matches(self, compiled: CompiledGrammar, text: str) -> bool:
        """``text`` is a complete match of the compiled grammar."""
        return self.backend(compiled.backend).matches(compiled, text)

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        """``[rows, ceil(vocab/32)]`` int32, all bits set (= no constraint)."""
        return allocate_bitmask(rows, self.vocab_size)

    def fill_bitmask(self, rows_and_matchers: Sequence[tuple[int, GrammarMatcher]], bitmask: torch.Tensor) -> None:
        """Fill only the given rows; other rows keep their contents (e.g. -1 for free rows)."""
        by_backend: dict[str, list[tuple[int, GrammarMatcher]]] = {}
        for row, m in rows_and_matchers:
            by_backend.setdefault(m.backend_name, []).append((row, m))
        for name, group in by_backend.items():
            self.backend(name).fill_bitmasks(group, bitmask)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
