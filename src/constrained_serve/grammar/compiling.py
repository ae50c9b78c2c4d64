"""The compile side of ``GrammarManager`` (manager.py): compiling specs in the compile
workers under ``compile_timeout_s``, the LRU cache of compiled grammars (one in-flight
compile per spec, shared), refusing at once a spec shaped like one whose compile overran
(``spec_shape``), evicting a grammar a matcher failed on, and checking finished outputs
(``matches``). ``CompileService`` holds that state; the workers are the ``WorkerPool``'s.

A grounded spec (grounding.py) has a grammar per source text, so per row of an extraction:
those are cached apart, by the digest of their source, in an LRU of their own of at most
``GROUNDED_CACHE_SIZE`` entries, so a long job never pushes the shared grammars out (a row's
samples and retries still share one compile). They compile like any spec, on the compile
threads when the request is added, while the rows before it decode.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import itertools
import json
import logging
import re
import threading
from typing import Any

from ..errors import GrammarError
from ..params import OutputSpec
from .base import CompiledGrammar
from .pool import WorkerPool, portable
from .worker import WorkerFailure

logger = logging.getLogger("constrained_serve.grammar.manager")

BACKENDS = ("llguidance", "xgrammar")
CacheKey = tuple[str, str, str, bool, bool, str]
GROUNDED_CACHE_SIZE = 16


def spec_shape(spec: OutputSpec, backend: str) -> tuple[str, str, str, bool, bool]:
    """A spec with the contents of its literals and regexes folded (runs of letters -> "a", of
    digits -> "0") and whitespace dropped: specs that differ by another letter in a regex or a
    reindent share a shape (and, for a runaway compile, its fate). Structure, rule names and
    JSON property names are kept: they make different grammars, not trivial edits."""
    if spec.is_json:
        try:
            text = json.dumps(_fold_patterns(json.loads(spec.text)), sort_keys=True, separators=(",", ":"))
        except ValueError:
            text = spec.text
    elif spec.kind == "regex":
        text = _fold(spec.text)
    elif spec.kind in ("lark", "ebnf"):
        text = _LITERAL.sub(lambda m: _fold(m.group()), spec.text)
    else:
        text = spec.text
    if spec.grounding is not None:  # sources of about the same length share a fate, not all sources
        text += f"|grounded:{len(spec.grounding.text).bit_length()}"
    return (backend, spec.kind, re.sub(r"\s+", "", text), spec.whitespace, spec.strict)


_LITERAL = re.compile(r'"(?:\\.|[^"\\])*"|/(?:\\.|[^/\\\n])+/[imslux]*')


def _fold(text: str) -> str:
    return re.sub(r"[0-9]+", "0", re.sub(r"[A-Za-z_]+", "a", text))


def _fold_patterns(schema: Any) -> Any:
    """A schema with its ``pattern`` values and ``patternProperties`` keys folded."""
    if isinstance(schema, dict):
        out = {}
        for k, v in schema.items():
            if k == "pattern" and isinstance(v, str):
                out[k] = _fold(v)
            elif k == "patternProperties" and isinstance(v, dict):
                out[k] = {_fold(p): _fold_patterns(s) for p, s in v.items()}
            else:
                out[k] = _fold_patterns(v)
        return out
    if isinstance(schema, list):
        return [_fold_patterns(x) for x in schema]
    return schema


def cache_key(spec: OutputSpec, backend: str) -> CacheKey:
    grounding = "" if spec.grounding is None else spec.grounding.key
    return (backend, spec.kind, spec.text, spec.whitespace, spec.strict, grounding)


class CompileService:
    """Compiling and caching grammars, in the pool's compile workers, on its own threads."""

    def __init__(
        self,
        workers: WorkerPool,
        default_backend: str,
        cache_size: int,
        compile_timeout_s: float,
        stats: dict[str, int],
    ):
        self._workers = workers
        self.default_backend = default_backend
        self.cache_size = cache_size
        self.compile_timeout_s = compile_timeout_s
        self._stats = stats  # the manager's counters: hits, misses, compiles, timeouts, ...
        self._lock = threading.RLock()  # the cache, the in-flight compiles, the timed-out shapes
        self._cache: collections.OrderedDict[CacheKey, CompiledGrammar] = collections.OrderedDict()
        # Grounded grammars (one per source text), apart: see the module docstring.
        self._grounded: collections.OrderedDict[CacheKey, CompiledGrammar] = collections.OrderedDict()
        self._pending: dict[CacheKey, cf.Future] = {}  # one in-flight compile per key, shared
        # Shapes of specs whose compile overran: (timeout it overran, the refusal's message).
        self._timed_out: collections.OrderedDict[tuple, tuple[float, str]] = collections.OrderedDict()
        self._gids = itertools.count(1)
        self._pool = cf.ThreadPoolExecutor(workers.max_compilers, thread_name_prefix="grammar-compile")

    def warm_up(self, name: str) -> cf.Future:
        """Start the backend's workers on a compile thread (a first request then finds them up)."""
        return self._pool.submit(self._workers.start_backend, name)

    def shutdown(self) -> None:
        """No more compiles: the queued ones are cancelled, the running ones left to end."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- compile -------------------------------------------------------------------------
    def compile_async(self, spec: OutputSpec, backend: str | None = None, timeout_s: float | None = None) -> cf.Future:
        """A future of the ``CompiledGrammar``; ``.result()`` raises GrammarError on failure.
        ``timeout_s``: this compile's deadline (None: ``compile_timeout_s``)."""
        name = backend or self.default_backend
        fut: cf.Future
        if name not in BACKENDS:
            fut = cf.Future()
            fut.set_exception(
                GrammarError(f"unknown grammar backend {name!r}; expected one of {BACKENDS}", backend=name)
            )
            return fut
        timeout = float(timeout_s or self.compile_timeout_s)
        key = cache_key(spec, name)
        with self._lock:
            cache = self._cache_of(spec)
            hit = cache.get(key)
            if hit is not None:
                cache.move_to_end(key)
                self._stats["hits"] += 1
                fut = cf.Future()
                fut.set_result(hit)
                return fut
            pending = self._pending.get(key)
            if pending is not None:  # in flight: share it
                self._stats["hits"] += 1
                return pending
            shape = spec_shape(spec, name)
            seen = self._timed_out.get(shape)
            if seen is not None and timeout <= seen[0]:
                self._timed_out.move_to_end(shape)
                self._stats["timeout_refusals"] += 1
                fut = cf.Future()
                fut.set_exception(GrammarError(seen[1], backend=name, reason="timeout"))
                return fut
            self._stats["misses"] += 1
            fut = self._pool.submit(self._compile_job, spec, name, key, timeout)
            self._pending[key] = fut
        return fut

    def compile(self, spec: OutputSpec, backend: str | None = None, timeout_s: float | None = None) -> CompiledGrammar:
        return self.compile_async(spec, backend, timeout_s).result()

    def _compile_job(self, spec: OutputSpec, name: str, key: CacheKey, timeout: float) -> CompiledGrammar:
        try:
            gid = next(self._gids)
            client = self._workers.checkout_compiler(name)
            try:
                [(ok, value)] = client.call([("compile", gid, portable(spec))], [timeout])
                if ok:
                    self._workers.loaded_in(client).add(gid)
            except WorkerFailure as e:
                if not e.overrun:
                    raise GrammarError(
                        f"{name}: the grammar worker failed while compiling the {spec.kind} spec: {e}",
                        backend=name,
                        reason="worker failure",
                    ) from None
                raise self._timed_out_error(spec, name, timeout, e.elapsed) from None
            finally:
                self._workers.release_compiler(name, client)
            if not ok:
                etype, message, reason = value
                if etype == "GrammarError":
                    raise GrammarError(message, backend=name, reason=reason)
                raise GrammarError(
                    f"{name}: unexpected error compiling the {spec.kind} spec: {etype}: {message}",
                    backend=name,
                    reason=message,
                )
            payload, warnings, compile_s = value
            compiled = CompiledGrammar(name, spec, None, compile_s, list(warnings), gid=gid, payload=payload)
            with self._lock:
                self._cache_put(key, compiled)
            return compiled
        finally:
            with self._lock:
                self._pending.pop(key, None)

    def _timed_out_error(
        self, spec: OutputSpec, name: str, timeout: float, elapsed: tuple[float, float | None] | None = None
    ) -> GrammarError:
        ran = ""
        if elapsed is not None:
            wall, cpu = elapsed
            ran = f"; it ran {wall:.1f} s" + ("" if cpu is None else f" and used {cpu:.1f} s of CPU")
        message = (
            f"{name}: compiling the {spec.kind} spec took longer than {timeout:g} s of CPU time (its worker "
            f"was killed{ran}); this spec, and specs of the same shape, are refused at once from now on "
            f"unless compile_timeout_s is raised"
        )
        with self._lock:
            self._stats["timeouts"] += 1
            shape = spec_shape(spec, name)
            self._timed_out[shape] = (timeout, message)
            self._timed_out.move_to_end(shape)
            while len(self._timed_out) > self.cache_size:
                self._timed_out.popitem(last=False)
        logger.warning("%s", message)
        return GrammarError(message, backend=name, reason="timeout")

    def _cache_of(self, spec: OutputSpec) -> collections.OrderedDict[CacheKey, CompiledGrammar]:
        return self._cache if spec.grounding is None else self._grounded

    def _cache_put(self, key: CacheKey, compiled: CompiledGrammar) -> None:
        """Cache a finished compile, least recently used out first (caller holds the lock)."""
        self._stats["compiles"] += 1
        cache = self._cache_of(compiled.spec)
        bound = self.cache_size if cache is self._cache else min(self.cache_size, GROUNDED_CACHE_SIZE)
        cache[key] = compiled
        cache.move_to_end(key)
        while len(cache) > bound:
            self._workers.retire(cache.popitem(last=False)[1].gid)

    def evict(self, compiled: CompiledGrammar) -> None:
        """Drop ``compiled`` from the cache: the next request with its spec compiles afresh."""
        with self._lock:
            key = cache_key(compiled.spec, compiled.backend)
            cache = self._cache_of(compiled.spec)
            if cache.get(key) is compiled:
                del cache[key]
                self._stats["evictions"] += 1
                logger.warning(
                    "%s grammar of a %s spec evicted after a matcher failure: the next request with it compiles afresh",
                    compiled.backend,
                    compiled.spec.kind,
                )
            self._workers.retire(compiled.gid)

    def matches(self, compiled: CompiledGrammar, text: str) -> bool:
        """``text`` is a complete match of the compiled grammar (checked in a compile worker;
        GrammarError if that overruns ``compile_timeout_s``)."""
        name = compiled.backend
        client = self._workers.checkout_compiler(name)
        try:
            items = (
                []
                if compiled.gid in self._workers.loaded_in(client)
                else [("load", compiled.gid, compiled.payload, portable(compiled.spec))]
            )
            items.append(("matches", compiled.gid, text))
            try:
                outcome = client.call(items, [self.compile_timeout_s] * len(items))
            except WorkerFailure as e:
                raise GrammarError(
                    f"{name}: checking a finished output against the {compiled.spec.kind} spec failed: {e}",
                    backend=name,
                    reason="worker failure",
                ) from None
            if len(items) == 2 and outcome[0][0]:
                self._workers.loaded_in(client).add(compiled.gid)
            ok, value = outcome[-1]
            if not ok:  # the worker dropped its copy (a broken one): the next check rebuilds it
                self._workers.loaded_in(client).discard(compiled.gid)
                raise GrammarError(
                    f"{name}: checking a finished output failed: {value[1]}", backend=name, reason=value[1]
                )
            return bool(value)
        finally:
            self._workers.release_compiler(name, client)
