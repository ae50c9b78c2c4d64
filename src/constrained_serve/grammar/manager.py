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
time they are used, and their work is retried.

``GrammarManager`` is the front of objects that each hold their own state: the workers and
what they hold (``pool.WorkerPool``), the compile side (``compiling.CompileService``: the
cache, in-flight compiles, refused shapes, ``matches``), the mask side (``masks.MaskService``:
the shared bitmask, fills and prefills), the matchers (``matching.MatcherService``) and the
batches of matcher work, with recovery (``batch.py``).

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

import concurrent.futures as cf
import logging
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..params import OutputSpec
from .base import CompiledGrammar, bitmask_width
from .batch import BatchContext
from .compiling import BACKENDS, CompileService, cache_key, spec_shape
from .masks import MaskService, PendingMasks
from .matchers import Advance, MatcherHandle
from .matching import MASK_TIMEOUTS_S, MatcherService, PendingAdvance
from .pool import WorkerPool
from .tokenizer_data import TokenizerData

logger = logging.getLogger(__name__)

__all__ = ["Advance", "BACKENDS", "MASK_TIMEOUTS_S", "GrammarManager", "MatcherHandle", "spec_shape"]


class GrammarManager:
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
        step_rows = max(1, int(max_rows))
        self.workers = WorkerPool(
            tokenizer,
            self.tokenizer_data,
            MaskService.new_bitmask(step_rows, self.width),
            # extra constructor kwargs per backend, e.g. {"xgrammar": {"lazy_masks": False}}
            {k: dict(v) for k, v in (backend_options or {}).items()},
            isolation,
            max_compilers=max(1, int(max_workers)),
            # Mask workers per backend (None: max_workers). A request's matcher lives in one of
            # them; their fills run in parallel. On a CPU device one: the forward has the cores.
            mask_workers=max(1, int(mask_threads or max_workers)),
        )
        self.compiler = CompileService(
            self.workers, default_backend, self.cache_size, self.compile_timeout_s, self.stats
        )
        self.batches = BatchContext(self.workers, self.compiler.evict, self.compile_timeout_s, self.stats)
        self.masks = MaskService(self.workers, self.batches, self.vocab_size, step_rows)
        self.matchers = MatcherService(self.workers, self.batches, self.masks, self.mask_timeout_s)
        self._closed = False
        # The pool refers to nothing that refers back to the manager, so the manager can be
        # collected, and its workers closed then.
        self._close_workers = weakref.finalize(self, self.workers.close)

    # -- compiling -----------------------------------------------------------------------
    cache_key = staticmethod(cache_key)

    def compile_async(self, spec: OutputSpec, backend: str | None = None, timeout_s: float | None = None) -> cf.Future:
        """A future of the ``CompiledGrammar``; ``.result()`` raises GrammarError on failure.
        ``timeout_s``: this compile's deadline (None: ``compile_timeout_s``)."""
        return self.compiler.compile_async(spec, backend, timeout_s)

    def compile(self, spec: OutputSpec, backend: str | None = None, timeout_s: float | None = None) -> CompiledGrammar:
        return self.compiler.compile_async(spec, backend, timeout_s).result()

    def evict(self, compiled: CompiledGrammar) -> None:
        """Drop ``compiled`` from the cache: the next request with its spec compiles afresh."""
        self.compiler.evict(compiled)

    def matches(self, compiled: CompiledGrammar, text: str) -> bool:
        """``text`` is a complete match of the compiled grammar (checked in a compile worker;
        GrammarError if that overruns ``compile_timeout_s``)."""
        return self.compiler.matches(compiled, text)

    def warm_up(self, backend: str | None = None) -> cf.Future:
        """Start the backend's workers in the background (a first request then finds them up)."""
        return self.compiler.warm_up(backend or self.default_backend)

    # -- matchers ------------------------------------------------------------------------
    def new_matcher(self, compiled: CompiledGrammar, mask_timeout_s: float | None = None) -> MatcherHandle:
        """A matcher at the grammar's start (made in its worker on first use)."""
        return self.matchers.new_matcher(compiled, mask_timeout_s)

    def release(self, h: MatcherHandle) -> None:
        """The request is done with its matcher (thread-safe; the worker drops it later)."""
        self.matchers.release(h)

    def advance(self, items: Sequence[tuple[MatcherHandle, Sequence[int], int, Sequence[int]]]) -> list[Advance | None]:
        """For each ``(handle, tokens, room, stop_ids)``: accept ``tokens``, then up to ``room``
        forced tokens (cut after the first of ``stop_ids``); one round trip per worker for
        all of them. None where the handle failed (``handle.failure`` says why)."""
        return self.matchers.advance_async(items).result()

    def advance_async(self, items: Sequence[tuple[MatcherHandle, Sequence[int], int, Sequence[int]]]) -> PendingAdvance:
        """``advance`` sent to the workers without waiting: ``result()`` collects it."""
        return self.matchers.advance_async(items)

    # -- masks ---------------------------------------------------------------------------
    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        """``[rows, ceil(vocab/32)]`` int32, all bits set (= no constraint)."""
        return self.masks.allocate_bitmask(rows)

    def pin_for_cuda(self) -> bool:
        """Keep the shared bitmask page-locked (now and after it grows), so steps copy their
        rows to the GPU asynchronously. False where CUDA cannot do it (copies still work)."""
        return self.masks.pin_for_cuda()

    def step_bitmask(self, rows: int) -> torch.Tensor:
        """A bitmask of ``rows`` rows, all bits set, in the memory the mask workers write to:
        the engine's per-step bitmask (valid until the next call)."""
        return self.masks.step_bitmask(rows)

    def prefill_masks(self, handles: Sequence[MatcherHandle]) -> None:
        """Start filling the masks of the handles' current states ahead of the next step
        (``MaskService.prefill_masks``)."""
        self.masks.prefill_masks(handles)

    def fill_bitmask_async(
        self, rows_and_handles: Sequence[tuple[int, MatcherHandle]], bitmask: torch.Tensor | np.ndarray | None = None
    ) -> PendingMasks:
        """Start filling ``bitmask[row]`` for each ``(row, handle)``; rows not listed keep their
        contents. ``bitmask`` from ``step_bitmask`` is written in place; another tensor or
        array gets the rows copied in by ``wait()``."""
        return self.masks.fill_bitmask_async(rows_and_handles, bitmask)

    def fill_bitmask(
        self, rows_and_handles: Sequence[tuple[int, MatcherHandle]], bitmask: torch.Tensor | np.ndarray | None = None
    ) -> list[MatcherHandle]:
        return self.masks.fill_bitmask(rows_and_handles, bitmask)

    # -- end -----------------------------------------------------------------------------
    def abandon_all(self) -> None:
        """Kill the mask workers (their state is unknown after an interrupted step); every
        matcher is rebuilt from its history on next use."""
        self.masks.drop_prefill()
        self.workers.kill_maskers()

    def worker_pids(self) -> list[int]:
        return self.workers.worker_pids()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.masks.drop_prefill()
        self.compiler.shutdown()
        self._close_workers()
