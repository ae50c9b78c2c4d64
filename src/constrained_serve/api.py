"""The public facade: ``Engine`` with generate / chat / generate_iter / stream / conversation.

It turns user inputs (strings, message lists, output specs) into ``Request`` objects, drives
``EngineCore`` and turns finished requests into ``Result`` objects, in input order.
"""

from __future__ import annotations

import logging
import os
import random
import threading
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .cache.manager import KVCacheManager
from .cache.pins import PinRegistry
from .cache.pool import PagePool
from .cache.radix import RadixCache
from .config import EngineConfig
from .engine.core import EngineCore
from .engine.request import Request
from .engine.scheduler import Scheduler
from .inputs import Call, EngineInputs, Messages
from .models import loader
from .models.llama import sliding_window_of
from .output import results as outputs
from .params import SamplingParams
from .result import Result
from .runtime.runner import ModelRunner
from .runtime.thread_tuner import ThreadTuner
from .streaming import EngineStreaming

if TYPE_CHECKING:
    from .conversation import Conversation
    from .grammar.manager import GrammarManager

logger = logging.getLogger(__name__)


def _done(x: Request | list[Request] | Result) -> bool:
    """An entry of a call's pending queue that can be handed back: an error Result, or a
    finished request (all n of them, for SamplingParams.n > 1)."""
    if isinstance(x, list):
        return all(r.finished for r in x)
    return isinstance(x, Result) or x.finished


def _requests(x: Request | list[Request] | Result) -> list[Request]:
    return x if isinstance(x, list) else [] if isinstance(x, Result) else [x]


class Engine(EngineInputs, EngineStreaming):
    """A causal LM turned into a structured-output engine. See README for examples."""

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        device: str = "auto",
        dtype: str | torch.dtype | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int | None = None,
        kv_cache_tokens: int | None = None,
        page_size: int = 16,
        **kwargs: Any,
    ) -> None:
        self.config = cfg = EngineConfig(
            model=model,
            device=device,
            dtype=dtype,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            kv_cache_tokens=kv_cache_tokens,
            page_size=page_size,
            **kwargs,
        )
        self.device = dev = cfg.torch_device()
        self.dtype = cfg.torch_dtype(dev)
        if dev.type == "cpu":
            torch.set_num_threads(cfg.cpu_threads())
        src = loader.resolve_model(cfg.model)
        self.hf_config, self.tokenizer = loader.load_config_and_tokenizer(src)
        model_len = self.hf_config.max_position_embeddings
        if cfg.max_model_len is not None:
            model_len = min(model_len, cfg.max_model_len)
        window = sliding_window_of(self.hf_config)
        if window is not None and window < model_len:
            # Full attention equals the model's windowed attention up to the window.
            logger.warning("the model attends within a sliding window of %d tokens: context capped there", window)
            model_len = window
        self.model = loader.build_model(src, self.hf_config, self.dtype, dev, cfg.load_format, max_positions=model_len)
        self.model_path = src.folder or src.gguf
        num_pages = self._num_pages(model_len)
        self.pool = PagePool(num_pages, cfg.page_size)
        radix = RadixCache(self.pool, cfg.page_size) if cfg.enable_prefix_cache else None
        self.max_model_len = min(model_len, num_pages * cfg.page_size)
        runner = ModelRunner(self.model, num_pages, cfg.page_size, dev, self.dtype)
        if dev.type == "cpu" and cfg.adaptive_threads:
            runner.thread_tuner = ThreadTuner(cfg.cpu_threads())
        if dev.type == "cuda" and cfg.cuda_graphs:
            runner.enable_decode_graphs(cfg.graph_batch(), self.max_model_len)
        # One thread at a time drives the core (adds, steps, aborts) and changes the cache
        # (conversation pins take it too). Calls from several threads still share batches:
        # every step advances every caller's requests, and each caller only waits for its own.
        self._core_lock = threading.RLock()
        pins = PinRegistry(self.pool, radix, self._core_lock, cfg.conversation_lock_fraction)
        self.kv = KVCacheManager(self.pool, radix, pins=pins, copy_page_prefix=runner.copy_page_prefix)
        scheduler = Scheduler(self.kv, cfg.max_num_seqs, cfg.batched_tokens(dev))
        self.core = EngineCore(
            runner,
            scheduler,
            self.kv,
            self.tokenizer,
            loader.eos_token_ids(self.hf_config, self.tokenizer),
            self.max_model_len,
            make_grammar=self._make_grammar,
            overlap=cfg.overlap,
            fast_forward=cfg.fast_forward,
            pipeline=cfg.pipeline if cfg.pipeline is not None else dev.type == "cuda",
        )
        self._rng = random.Random(cfg.seed)
        logger.info(
            "engine ready: %s on %s (%s), %d KV pages of %d tokens",
            self.model_path,
            dev,
            self.dtype,
            num_pages,
            cfg.page_size,
        )

    # ------------------------------------------------------------------ set-up helpers
    def _num_pages(self, model_len: int) -> int:
        cfg = self.config
        per_token = ModelRunner.kv_bytes_per_token(self.model, self.dtype)
        if cfg.kv_cache_tokens is not None:
            tokens = cfg.kv_cache_tokens
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            tokens = int(free * cfg.kv_cache_memory_fraction) // per_token
        else:
            tokens = 32768
        return max(1, tokens // cfg.page_size)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The tokens that end an output (the core's set, read-only)."""
        return frozenset(self.core.eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return self.model.arch.vocab_size

    @property
    def grammar(self) -> "GrammarManager":
        """The GrammarManager, created on first use (building the token tables takes a moment)."""
        return self.core.grammar_manager()

    def _make_grammar(self) -> "GrammarManager":
        from .grammar.manager import GrammarManager

        cfg = self.config
        grammar = GrammarManager(
            self.tokenizer,
            self.vocab_size,
            default_backend=cfg.grammar_backend,
            eos_token_ids=sorted(self.eos_token_ids),
            mask_threads=self._mask_workers(),
            compile_timeout_s=cfg.grammar_compile_timeout_s,
            mask_timeout_s=cfg.grammar_mask_timeout_s,
            isolation=cfg.grammar_isolation,
            max_rows=cfg.max_num_seqs,
        )
        if self.device.type == "cuda":
            grammar.pin_for_cuda()  # the step's mask rows reach the GPU without a host wait
        grammar.warm_up()  # its workers start while the first spec compiles
        return grammar

    def _mask_workers(self) -> int:
        """On CPU one (the forward has the cores); on CUDA rows split over up to 8 workers."""
        if self.config.grammar_mask_workers is not None:
            return self.config.grammar_mask_workers
        return 1 if self.device.type == "cpu" else min(8, max(2, (os.cpu_count() or 2) // 2))

    # ------------------------------------------------------------------ outputs
    def _hand_back(self, x: Request | list[Request] | Result, prompt: Any, raise_on_error: bool) -> Result:
        """The Result of a pending entry that is done (see outputs.py)."""
        if isinstance(x, Result):
            return x
        group = x if isinstance(x, list) else [x]
        return outputs.result_of(group, prompt, raise_on_error, self.core.grammar, self.max_model_len)

    # ------------------------------------------------------------------ generate
    def generate(
        self,
        prompts: str | Sequence[str],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: bool = False,
        raise_on_error: bool = False,
        **spec_kwargs: Any,
    ) -> list[Result]:
        """Raw prompts (no chat template). One Result per prompt, in input order.

        ``params`` is one SamplingParams for all prompts or a list with one per prompt."""
        call = Call.of(prompts, params, False, spec_kwargs, raise_on_error=raise_on_error, progress=progress)
        return list(self._iter(call))

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: bool = False,
        raise_on_error: bool = False,
        **spec_kwargs: Any,
    ) -> list[Result]:
        """Message lists, rendered with the model's chat template. One Result per conversation.

        ``params`` is one SamplingParams for all conversations or a list with one per conversation."""
        call = Call.of(messages, params, True, spec_kwargs, raise_on_error=raise_on_error, progress=progress)
        return list(self._iter(call))

    def generate_iter(
        self,
        prompts: Iterable[Any],
        params: SamplingParams | None = None,
        *,
        chat: bool = False,
        max_in_flight: int = 256,
        progress: bool = False,
        raise_on_error: bool = False,
        **spec_kwargs: Any,
    ) -> Iterator[Result]:
        """Stream over a long iterable: continuous batching across items, results in input order.
        At most ``max_in_flight`` requests are submitted ahead (a prompt with ``n`` samples
        counts ``n``), so memory stays bounded however long the iterable.

        Per-item problems (too long, bad per-item input) come back as error Results."""
        call = Call(prompts, params, chat, spec_kwargs, raise_on_error=raise_on_error, progress=progress)
        return self._iter(call, max_in_flight)

    def _iter(self, call: Call, max_in_flight: int | None = None) -> Iterator[Result]:
        """The call's Results in input order, stepping the engine meanwhile. With
        ``max_in_flight`` None every item is submitted at once (generate, chat: a list)."""
        plan = self._plan(call)
        bar = None
        if call.progress:
            from tqdm.auto import tqdm

            total = len(call.items) if max_in_flight is None and isinstance(call.items, list) else None
            bar = tqdm(total=total, desc="generate", unit="req")
        pending: deque[tuple[int, Any, Request | Result]] = deque()
        limit = max_in_flight or (1 << 62)
        in_flight = 0  # entries not handed back, weighed in requests: n for a prompt sampled n times
        it = iter(enumerate(call.items))
        exhausted = False
        try:
            while True:
                while not exhausted and in_flight < limit:
                    nxt = next(it, None)
                    if nxt is None:
                        exhausted = True
                        break
                    i, item = nxt
                    group = self._requests_or_error(call, plan, i, item)
                    if isinstance(group, Result):
                        pending.append((i, item, group))
                        in_flight += 1
                        continue
                    with self._core_lock:
                        for r in group:
                            self.core.add(r)
                    pending.append((i, item, group if len(group) > 1 else group[0]))
                    in_flight += len(group)
                # Yield finished heads in order, then step.
                while pending and _done(pending[0][2]):
                    i, item, x = pending.popleft()
                    in_flight -= max(1, len(_requests(x)))
                    res = self._hand_back(x, item, call.raise_on_error)
                    if bar is not None:
                        bar.update(1)
                    yield res
                if not pending and exhausted:
                    return
                with self._core_lock:  # another thread's step may have finished ours meanwhile
                    if pending and not _done(pending[0][2]):
                        self._step_for(next(r for r in _requests(pending[0][2]) if not r.finished))
        finally:
            if bar is not None:
                bar.close()
            with self._core_lock:
                for _, _, x in pending:  # the caller stopped early: free what is still running
                    for r in _requests(x):
                        if not r.finished:
                            self.core.abort(r)
                self.core.drain_finished()

    def _step_for(self, r: Request) -> None:
        """One step for a caller waiting on r (under the core lock). An unfinished request
        the core no longer holds would make its caller spin forever: fail loudly instead."""
        if not self.core.has_work():
            raise RuntimeError(
                f"request {r.request_id} is unfinished but no longer scheduled "
                "(engine state lost, e.g. after an error inside a step)"
            )
        self.core.step()

    # ------------------------------------------------------------------ conversations
    def conversation(self, system: str | None = None, params: SamplingParams | None = None) -> Conversation:
        from .conversation import Conversation

        return Conversation(self, system=system, params=params)
