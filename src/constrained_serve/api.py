"""The public facade: ``Engine`` with generate / chat / generate_iter / stream / conversation.

``Engine`` is composed of smaller objects: ``inputs`` (a ``RequestBuilder``, inputs.py) turns
user inputs (strings, message lists, output specs) into ``Request`` objects, ``driver`` (a
``Driver``, engine/driver.py) owns the core lock and adds, steps and aborts them on
``core`` (``EngineCore``), and finished requests become ``Result`` objects (output/results.py),
in input order. ``entries`` and ``result_of`` are that path as a public, typed API, which
``AsyncEngine`` uses too.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .cache.manager import KVCacheManager
from .cache.pins import PinRegistry
from .cache.pool import PagePool
from .cache.radix import RadixCache
from .call import Call, Entry, Messages
from .config import EngineConfig
from .conversation import Conversation
from .engine.core import EngineCore
from .engine.driver import Driver
from .engine.scheduler import Scheduler
from .inputs import RequestBuilder
from .models import loader
from .models.llama import sliding_window_of
from .output import results as outputs
from .params import OutputSpec, SamplingParams
from .result import Result
from .runtime import cpu_dtype
from .runtime.runner import ModelRunner
from .runtime.thread_tuner import ThreadTuner
from .streaming import PartialStream, stream_partial, stream_text

if TYPE_CHECKING:
    from .grammar.manager import GrammarManager

logger = logging.getLogger(__name__)


class Engine:
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
        if dev.type == "cpu":
            torch.set_num_threads(cfg.cpu_threads())
        src = loader.resolve_model(cfg.model)
        # The model's dtype, and why: as asked, the device's default, or on CPU the verdict of
        # a check of bf16 against fp32 on this model (runtime/cpu_dtype.py).
        self.dtype, self.dtype_reason = self._choose_dtype(src)
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
        # (conversation pins take it too): the driver's lock, see engine/driver.py.
        lock = threading.RLock()
        pins = PinRegistry(self.pool, radix, lock, cfg.conversation_lock_fraction)
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
        self.driver = Driver(self.core, lock)
        self.inputs = RequestBuilder(
            self.tokenizer, self.vocab_size, self.max_model_len, self.core.grammar_manager, seed=cfg.seed
        )
        logger.info(
            "engine ready: %s on %s (%s), %d KV pages of %d tokens",
            self.model_path,
            dev,
            self.dtype,
            num_pages,
            cfg.page_size,
        )

    # ------------------------------------------------------------------ set-up helpers
    def _choose_dtype(self, src: loader.ModelSource) -> tuple[torch.dtype, str]:
        cfg, dev = self.config, self.device
        if cfg.dtype is not None:
            return cfg.torch_dtype(dev), f"dtype={cfg.dtype!r} as asked"
        if dev.type != "cpu":
            return cfg.torch_dtype(dev), f"the {dev.type} default"
        model = src.folder or src.gguf
        choice = cpu_dtype.choose(
            model,
            cfg.load_format,
            cfg.cpu_threads(),
            lambda dtype: self._check_decoder(model, dtype),
            enabled=cfg.auto_bf16,
        )
        return choice.dtype, choice.reason

    def _check_decoder(self, model: os.PathLike | None, dtype: torch.dtype) -> cpu_dtype.GreedyDecoder:
        """Greedy outputs of a small engine on this model in ``dtype``, for the bf16 check: the
        dtype explicit (no check of its own), the pool small, no prefix cache (every timed row
        computes its prompt), the thread count fixed (a tuner probe would skew the timing)."""
        cfg = self.config
        check = Engine(
            model=model,
            device="cpu",
            dtype=dtype,
            max_num_seqs=cpu_dtype.TIMED_ROWS,
            kv_cache_tokens=cpu_dtype.CHECK_KV_TOKENS,
            enable_prefix_cache=False,
            num_threads=cfg.cpu_threads(),
            adaptive_threads=False,
            load_format=cfg.load_format,
        )

        def decode(prompts: Sequence[str], max_tokens: int, logprobs: int | None) -> list[cpu_dtype.Greedy]:
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
            results = check.generate(list(prompts), params, raise_on_error=True)
            return [cpu_dtype.Greedy(r.token_ids, [dict(t or {}) for t in r.logprobs or []]) for r in results]

        return decode

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

    # ------------------------------------------------------------------ inputs
    def encode_prompt(self, prompt: str) -> list[int]:
        """A raw prompt's token ids (with the tokenizer's special tokens, e.g. BOS)."""
        return self.inputs.encode_prompt(prompt)

    def render_chat(self, messages: Messages, add_generation_prompt: bool = True) -> str:
        """A message list rendered by the model's chat template (ValueError if it cannot be)."""
        return self.inputs.render_chat(messages, add_generation_prompt)

    def encode_chat(self, messages: Messages) -> list[int]:
        """A message list's token ids, through the chat template with the generation prompt."""
        return self.inputs.encode_chat(messages)

    def make_spec(self, **spec_kwargs: Any) -> OutputSpec | None:
        """The output spec of schema= / regex= / grammar= / choices= / response_format= (None without one)."""
        return self.inputs.make_spec(**spec_kwargs)

    # ------------------------------------------------------------------ submission
    def entries(self, call: Call) -> Iterator[Entry]:
        """One ``Entry`` per item of ``call``, built as the iterator is read: the item's
        requests, not added to the core yet (add them with ``driver.add``), or the error Result
        of an item that failed alone. What the items share (params, a shared spec, keywords) is
        checked here, at the call: a bad one raises before any model work."""
        return self.inputs.entries(call)

    def result_of(self, entry: Entry, raise_on_error: bool = False) -> Result:
        """The Result of a done entry (``entry.done``): its error Result, or its finished
        request(s) as text, usage and the parsed value (output/results.py). ``raise_on_error``
        raises the output's error instead of reporting it on the Result."""
        if entry.error is not None:
            return entry.error
        res = outputs.result_of(entry.requests, entry.item, raise_on_error, self.core.grammar, self.max_model_len)
        if entry.tools is not None:  # a chat with tools: the calls out of the text
            entry.tools.fill(res, raise_on_error)
        return res

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
        tools: Sequence[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        progress: bool = False,
        raise_on_error: bool = False,
        **spec_kwargs: Any,
    ) -> list[Result]:
        """Message lists, rendered with the model's chat template. One Result per conversation.

        ``params`` is one SamplingParams for all conversations or a list with one per conversation.

        ``tools`` (OpenAI's ``{"type": "function", "function": {...}}`` dicts): the model may
        call them, under ``tool_choice`` "auto" (the default: text or calls), "required", a
        named function ``{"type": "function", "function": {"name": ...}}`` or "none";
        ``parallel_tool_calls`` lets it make several calls (default: True, except for a named
        function: one call). Every call in
        ``Result.tool_calls`` parses and matches its function's parameters (docs/api.md)."""
        spec_kwargs = _with_tools(spec_kwargs, tools, tool_choice, parallel_tool_calls)
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
        entries = self.entries(call)
        bar = None
        if call.progress:
            from tqdm.auto import tqdm

            total = len(call.items) if max_in_flight is None and isinstance(call.items, list) else None
            bar = tqdm(total=total, desc="generate", unit="req")
        pending: deque[Entry] = deque()
        limit = max_in_flight or (1 << 62)
        in_flight = 0  # entries not handed back, weighed in requests: n for a prompt sampled n times
        exhausted = False
        try:
            while True:
                while not exhausted and in_flight < limit:
                    entry = next(entries, None)
                    if entry is None:
                        exhausted = True
                        break
                    self.driver.add(entry.requests)
                    pending.append(entry)
                    in_flight += entry.weight
                # Yield finished heads in order, then step.
                while pending and pending[0].done:
                    entry = pending.popleft()
                    in_flight -= entry.weight
                    res = self.result_of(entry, call.raise_on_error)
                    if bar is not None:
                        bar.update(1)
                    yield res
                if not pending and exhausted:
                    return
                if pending:  # another thread's step may have finished its requests meanwhile
                    self.driver.step_for(pending[0].requests)
        finally:
            if bar is not None:
                bar.close()
            # The caller stopped early: free what is still running.
            self.driver.abort([r for entry in pending for r in entry.requests])

    # ------------------------------------------------------------------ streams
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
        [entry] = self.entries(Call.stream(prompt, params, spec_kwargs))
        [r] = entry.requests
        if not partial:
            return stream_text(self.driver, r)
        objects = PartialStream(r)
        return stream_partial(stream_text(self.driver, r), objects, lambda: self.result_of(entry))

    # ------------------------------------------------------------------ conversations
    def conversation(self, system: str | None = None, params: SamplingParams | None = None) -> Conversation:
        """A multi-turn conversation on the cached KV (conversation.py)."""
        return Conversation(self, system=system, params=params)


def _with_tools(spec_kwargs: dict[str, Any], tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> dict[str, Any]:
    """chat()'s tool keywords among the spec keywords (inputs.py reads them there), when given."""
    given = {"tools": tools, "tool_choice": tool_choice, "parallel_tool_calls": parallel_tool_calls}
    return {**spec_kwargs, **{k: v for k, v in given.items() if v is not None}}
