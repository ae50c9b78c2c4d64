"""Engine-level grammar service: compiles (cached, bounded), matchers and masks, all of it in
worker processes under deadlines, so no spec a user sends can hang, spin or poison the engine.

Two kinds of worker per backend (``worker.py``): compile workers (up to ``max_workers``) compile
specs and check finished outputs (``matches``); mask workers (``mask_threads`` of them) hold
the requests' matchers and write mask rows into the shared step bitmask. A compile that
overruns ``compile_timeout_s``, or a matcher operation that overruns its request's
``mask_timeout_s`` (by default 0.5 s with llguidance, 3 s with xgrammar), gets its worker
killed (its memory comes back) and restarted; the request it was working for fails alone
with a ``GrammarError`` naming the cause. The other matchers of a killed mask worker are
rebuilt in the new one from the tokens they had accepted (``history``), lazily, the next
time they are used, and their work is retried. The compile side lives in ``compiling.py``,
the mask side (the shared bitmask, fills and prefills) in ``masks.py``.

- A spec whose compile timed out is remembered by its shape (``spec_shape``: the spec with
  letters and digits folded, so trivial edits of a runaway grammar do not start another)
  and refused at once, unless retried with a larger ``compile_timeout_s``.
- A matcher that fails (a parser limit such as llguidance's "too many expressions
  constructed", an overrun, a crash) evicts its compiled grammar: llguidance's matchers share
  state with their template, and one such failure can break every later matcher made from it.
  The next request with that spec compiles afresh.
- ``isolation="inline"`` runs the same code in this process, without deadlines (a runaway
  then hangs the caller): for debugging, and as the baseline ``benchmarks/masks.py`` compares.

Typical engine use (mask operations come from one thread at a time: the step loop)::

    gm = GrammarManager(tokenizer, vocab_size=model_logits_width)
    fut = gm.compile_async(spec)                  # at submit; GrammarError via fut.result()
    h = gm.new_matcher(fut.result())              # when the request is scheduled
    [adv] = gm.advance([(h, [], room, stop_ids)])  # tokens forced at the start
    pending = gm.fill_bitmask_async([(row, h)], bitmask)   # before the forward ...
    pending.wait()                                 # ... after it; failures in h.failure
    [adv] = gm.advance([(h, [sampled], room, stop_ids)])
    gm.release(h)                                  # when the request ends
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import itertools
import logging
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import GrammarError
from .base import CompiledGrammar, bitmask_width
from .compiling import BACKENDS, CacheKey, GrammarCompiling, spec_shape
from .host import InlineClient
from .masks import GrammarMasks
from .matchers import Advance, MatcherHandle, PendingAdvance, PendingMasks, _Batch, _Entry, _Live
from .tokenizer_data import TokenizerData
from .worker import SharedBitmask, WorkerClient

logger = logging.getLogger(__name__)

__all__ = ["Advance", "BACKENDS", "GrammarManager", "MatcherHandle", "spec_shape"]

# Default deadline of one request's grammar work in a step, per backend. llguidance fills a
# mask in microseconds (p99 0.13 ms, max 1.3 ms over JSONSchemaBench on the 2-core CI box);
# xgrammar builds each parser state's mask lazily, the first time it is met: p99 100 ms,
# and up to 1.3 s for the largest schemas there (benchmarks/masks.py).
MASK_TIMEOUTS_S = {"llguidance": 0.5, "xgrammar": 3.0}


class GrammarManager(GrammarCompiling, GrammarMasks):
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        default_backend: str = "llguidance",
        max_workers: int = 2,
        cache_size: int = 256,
        eos_token_ids: Sequence[int] | None = None,
        compile_timeout_s: float = 10.0,
        backend_options: dict[str, dict[str, Any]] | None = None,
        mask_threads: int | None = None,
        mask_timeout_s: float | None = None,
        isolation: str = "process",
        max_rows: int = 64,
    ):
        if default_backend not in BACKENDS:
            raise ValueError(f"default_backend must be one of {BACKENDS}, got {default_backend!r}")
        if isolation not in ("process", "inline"):
            raise ValueError(f"isolation must be 'process' or 'inline', got {isolation!r}")
        for name, v in (("compile_timeout_s", compile_timeout_s), ("mask_timeout_s", mask_timeout_s or 1.0)):
            if not v > 0:
                raise ValueError(f"{name} must be > 0, got {v!r}")
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.width = bitmask_width(self.vocab_size)
        self.default_backend = default_backend
        self.tokenizer_data = TokenizerData.from_hf(tokenizer, self.vocab_size, eos_token_ids)
        self.eos_token_ids = list(self.tokenizer_data.eos_token_ids)
        self.cache_size = int(cache_size)
        self.compile_timeout_s = float(compile_timeout_s)
        # None: each backend's own (MASK_TIMEOUTS_S)
        self.mask_timeout_s = float(mask_timeout_s) if mask_timeout_s is not None else None
        self.isolation = isolation
        self._max_compilers = max(1, int(max_workers))
        # Mask workers per backend (None: max_workers). A request's matcher lives in one of
        # them; their fills run in parallel. On a CPU device one: the forward has the cores.
        self._mask_workers = max(1, int(mask_threads or max_workers))
        # extra constructor kwargs per backend, e.g. {"xgrammar": {"lazy_masks": False}}
        self._backend_options = {k: dict(v) for k, v in (backend_options or {}).items()}
        self._lock = threading.RLock()  # the cache, the compile workers, the registries
        self._idle = threading.Condition(self._lock)
        self._cache: collections.OrderedDict[CacheKey, CompiledGrammar] = collections.OrderedDict()
        self._pending: dict[CacheKey, cf.Future] = {}  # one in-flight compile per key, shared
        # Shapes of specs whose compile overran: (timeout it overran, the refusal's message).
        self._timed_out: collections.OrderedDict[tuple, tuple[float, str]] = collections.OrderedDict()
        self._compilers: dict[str, list[Any]] = {}
        self._idle_compilers: dict[str, list[Any]] = {}
        self._maskers: dict[str, list[Any]] = {}
        self._next_masker: dict[str, int] = {}
        self._tokenizers: dict[str, TokenizerData] = {}
        # gids each worker holds, as of its current epoch; gids retired from the cache, and
        # live matchers per gid (a retired gid is unloaded when its last matcher goes).
        self._loaded: dict[Any, tuple[int, set[int]]] = {}
        self._retired: set[int] = set()
        self._live_per_gid: collections.Counter = collections.Counter()
        self._released: collections.deque[_Live] = collections.deque()  # appended by finalizers too
        self._queued: dict[Any, list[tuple]] = collections.defaultdict(list)
        self._gids = itertools.count(1)
        self._mids = itertools.count(1)
        # The shared bitmask holds a step's rows, then as many prefill slots (prefill_masks).
        self._step_rows = max(1, int(max_rows))
        self._bitmask = SharedBitmask(2 * self._step_rows, self.width)
        self._bitmask_t = torch.from_numpy(self._bitmask.array)
        self._prefill: PendingMasks | None = None  # the prefill batch in flight, if any
        self._pin = False  # page-lock the bitmask for CUDA copies (pin_for_cuda)
        self._prefill_gen = 0  # bumped by each prefill: only the latest one's slots are valid
        self._pool = cf.ThreadPoolExecutor(self._max_compilers, thread_name_prefix="grammar-compile")
        self._closed = False
        # timeouts: compiles killed at compile_timeout_s; timeout_refusals: specs refused for
        # the shape of one that timed out; mask_overruns: matcher operations killed
        self.stats = {
            "hits": 0,
            "misses": 0,
            "compiles": 0,
            "timeouts": 0,
            "timeout_refusals": 0,
            "mask_overruns": 0,
            "worker_restarts": 0,
            "evictions": 0,
            "prefilled_rows": 0,  # mask rows a step took from prefill_masks instead of a fill
        }
        weakref.finalize(self, GrammarManager._close_all, self._compilers, self._maskers, self._bitmask)

    # -- workers -------------------------------------------------------------------------
    def _tokenizer_for(self, name: str) -> TokenizerData:
        with self._lock:
            data = self._tokenizers.get(name)
            if data is None:
                data = self.tokenizer_data
                if name == "xgrammar":
                    data = data.with_xgrammar_info(self.tokenizer)
                self._tokenizers[name] = data
            return data

    def _client(self, name: str, label: str, bitmask: SharedBitmask | None) -> Any:
        cls = WorkerClient if self.isolation == "process" else InlineClient
        return cls(name, self._tokenizer_for(name), self._backend_options.get(name, {}), bitmask, label)

    def _maskers_for(self, name: str) -> list[Any]:
        with self._lock:
            clients = self._maskers.get(name)
            if clients is None:
                clients = self._maskers[name] = [
                    self._client(name, f"{name} mask #{i}", self._bitmask) for i in range(self._mask_workers)
                ]
            return clients

    def warm_up(self, backend: str | None = None) -> cf.Future:
        """Start the backend's workers in the background (a first request then finds them up)."""
        name = backend or self.default_backend

        def start() -> None:
            self._release_compiler(name, self._checkout_compiler(name, start=True))
            for c in self._maskers_for(name):
                c.start()

        return self._pool.submit(start)

    def new_matcher(self, compiled: CompiledGrammar, mask_timeout_s: float | None = None) -> MatcherHandle:
        """A matcher at the grammar's start (made in its worker on first use)."""
        clients = self._maskers_for(compiled.backend)
        with self._lock:
            i = self._next_masker.get(compiled.backend, 0)
            self._next_masker[compiled.backend] = (i + 1) % len(clients)
            live = _Live(next(self._mids), compiled.gid, clients[i])
            self._live_per_gid[compiled.gid] += 1
        deadline = mask_timeout_s or self.mask_timeout_s or MASK_TIMEOUTS_S[compiled.backend]
        h = MatcherHandle(self, compiled, live, float(deadline))
        weakref.finalize(h, self._released.append, live)
        return h

    def release(self, h: MatcherHandle) -> None:
        """The request is done with its matcher (thread-safe; the worker drops it later)."""
        self._released.append(h.live)

    def _prologue(self, client: Any) -> list[tuple]:
        """Drops and unloads owed to ``client``, sent ahead of its next batch."""
        with self._lock:
            while self._released:
                live = self._released.popleft()
                if live.released:
                    continue
                live.released = True
                if live.epoch == live.client.epoch and live.epoch:
                    self._queued[live.client].append(("drop", live.mid))
                self._live_per_gid[live.gid] -= 1
                if self._live_per_gid[live.gid] <= 0:
                    del self._live_per_gid[live.gid]
                    if live.gid in self._retired:
                        self._unload(live.gid)
            return self._queued.pop(client, [])

    def _fail(self, h: MatcherHandle, reason: str, evict: bool = True) -> None:
        if h.failure is None:
            h.failure = reason
            if evict:
                self.evict(h.compiled)

    def _run(self, entries: list[_Entry]) -> list[_Entry]:
        self._submit(entries).finish()
        return entries

    def _submit(self, entries: list[_Entry]) -> _Batch:
        self._settle_prefill()
        for e in entries:  # the operation changes (or may change) the matcher's state
            e.handle.prefilled = None
        return _Batch(self, entries).start()

    def _single(self, h: MatcherHandle, item: tuple) -> Any:
        """One operation on one matcher, and its state after it: one round trip."""
        e, s = self._run([_Entry(h, item, h.mask_timeout_s), _Entry(h, ("state",), h.mask_timeout_s)])
        if not e.ok:
            raise GrammarError(f"{h.backend_name}: {e.value}", backend=h.backend_name, reason=e.value)
        if item[0] == "accept" and e.value:
            h.history.extend(item[1])
        elif item[0] == "rollback" and item[1] > 0:
            del h.history[len(h.history) - item[1] :]
        if s.ok:
            h.finished, h.can_end_now, _ = s.value
        return e.value

    def advance(self, items: Sequence[tuple[MatcherHandle, Sequence[int], int, Sequence[int]]]) -> list[Advance | None]:
        """For each ``(handle, tokens, room, stop_ids)``: accept ``tokens``, then up to ``room``
        forced tokens (cut after the first of ``stop_ids``); one round trip per worker for
        all of them. None where the handle failed (``handle.failure`` says why)."""
        return self.advance_async(items).result()

    def advance_async(self, items: Sequence[tuple[MatcherHandle, Sequence[int], int, Sequence[int]]]) -> PendingAdvance:
        """``advance`` sent to the workers without waiting: ``result()`` collects it."""
        entries = [
            _Entry(h, ("advance", list(toks), int(room), tuple(stop)), h.mask_timeout_s)
            for h, toks, room, stop in items
        ]
        return PendingAdvance(self._submit(entries), lambda: self._finish_advance(entries))

    def _finish_advance(self, entries: list[_Entry]) -> list[Advance | None]:
        out: list[Advance | None] = []
        for en in entries:
            h = en.handle
            if not en.ok:
                out.append(None)
                continue
            a = Advance._make(en.value)
            if a.accepted:
                h.history.extend(en.item[1])
                h.history.extend(a.forced)
                h.finished, h.can_end_now = a.finished, a.can_end
            if a.error is not None:
                self._fail(h, a.error)
                out.append(None)
                continue
            out.append(a)
        return out

    # -- end -----------------------------------------------------------------------------
    def abandon_all(self) -> None:
        """Kill the mask workers (their state is unknown after an interrupted step); every
        matcher is rebuilt from its history on next use."""
        self._drop_prefill()
        for clients in self._maskers.values():
            for c in clients:
                c.kill()

    def worker_pids(self) -> list[int]:
        with self._lock:
            clients = [c for cs in list(self._compilers.values()) + list(self._maskers.values()) for c in cs]
        return [c.pid for c in clients if c.alive and c.pid is not None]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._drop_prefill()
        self._pool.shutdown(wait=False, cancel_futures=True)
        GrammarManager._close_all(self._compilers, self._maskers, self._bitmask)

    @staticmethod
    def _close_all(compilers: dict, maskers: dict, bitmask: SharedBitmask) -> None:
        for clients in list(compilers.values()) + list(maskers.values()):
            for c in clients:
                c.close()
        bitmask.close()
