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
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from . import outputs
from .cache.manager import KVCacheManager
from .cache.pins import PinRegistry
from .cache.pool import PagePool
from .cache.radix import RadixCache
from .config import EngineConfig
from .engine import EngineCore
from .errors import GrammarError, OutputError, PromptTooLongError
from .models import loader
from .models.llama import sliding_window_of
from .params import OutputSpec, SamplingParams
from .request import GrammarState, Request
from .result import Result
from .runner import ModelRunner
from .sampler import step_seed
from .scheduler import Scheduler

if TYPE_CHECKING:
    from .conversation import Conversation
    from .grammar.manager import GrammarManager

logger = logging.getLogger(__name__)


def _per_prompt(key: str, value: Any) -> bool:
    """A list is one spec per prompt, except choices=["yes", "no"] (one spec for all)."""
    return isinstance(value, list) and (
        key != "choices" or (len(value) > 0 and all(isinstance(x, (list, tuple)) or x is None for x in value))
    )


def _done(x: Request | list[Request] | Result) -> bool:
    """An entry of a call's pending queue that can be handed back: an error Result, or a
    finished request (all n of them, for SamplingParams.n > 1)."""
    if isinstance(x, list):
        return all(r.finished for r in x)
    return isinstance(x, Result) or x.finished


def _requests(x: Request | list[Request] | Result) -> list[Request]:
    return x if isinstance(x, list) else [] if isinstance(x, Result) else [x]


Messages = list[dict[str, Any]]
ParamsArg = SamplingParams | Sequence[SamplingParams] | None  # one for all items, or one each
_SPEC_KEYS = ("schema", "regex", "grammar", "choices", "response_format")


def split_chat_messages(messages: Any) -> tuple[list[Messages], bool]:
    """``chat()``'s input as a list of conversations, and whether it was one conversation
    (a list of messages) rather than a list of them."""
    if isinstance(messages, (str, bytes, dict)):
        raise TypeError(
            f"chat() takes a list of {{'role': ..., 'content': ...}} messages (or a list of such "
            f"lists), got a {type(messages).__name__}; for raw text use generate()"
        )
    single = len(messages) > 0 and isinstance(messages[0], dict)
    return ([messages] if single else list(messages)), single


@dataclass(frozen=True)
class _CallPlan:
    """What the items of one generate/chat call share (see Engine._plan)."""

    params_at: Callable[[int], SamplingParams]
    backend: str | None
    per_item_specs: list[dict[str, Any]]
    per_prompt: bool
    shared_spec: OutputSpec | None
    chat: bool


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
        # One thread at a time drives the core (adds, steps, aborts) and changes the cache
        # (conversation pins take it too). Calls from several threads still share batches:
        # every step advances every caller's requests, and each caller only waits for its own.
        self._core_lock = threading.RLock()
        pins = PinRegistry(self.pool, radix, self._core_lock, cfg.conversation_lock_fraction)
        self.kv = KVCacheManager(self.pool, radix, pins=pins, copy_page_prefix=runner.copy_page_prefix)
        scheduler = Scheduler(self.kv, cfg.max_num_seqs, cfg.batched_tokens(dev))
        self.eos_token_ids: frozenset[int] = frozenset(loader.eos_token_ids(self.hf_config, self.tokenizer))
        self.core = EngineCore(
            runner,
            scheduler,
            self.kv,
            self.tokenizer,
            set(self.eos_token_ids),
            self.max_model_len,
            make_grammar=self._make_grammar,
            overlap=cfg.overlap,
            fast_forward=cfg.fast_forward,
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
        grammar.warm_up()  # its workers start while the first spec compiles
        return grammar

    def _mask_workers(self) -> int:
        """On CPU one (the forward has the cores); on CUDA rows split over up to 8 workers."""
        if self.config.grammar_mask_workers is not None:
            return self.config.grammar_mask_workers
        return 1 if self.device.type == "cpu" else min(8, max(2, (os.cpu_count() or 2) // 2))

    # ------------------------------------------------------------------ inputs
    def encode_prompt(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def render_chat(self, messages: Messages, add_generation_prompt: bool = True) -> str:
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
        ):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
        try:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except Exception as e:  # jinja2 errors, a template's raise_exception(): this item's problem
            raise ValueError(f"the chat template cannot render these messages: {type(e).__name__}: {e}") from e

    def encode_chat(self, messages: Messages) -> list[int]:
        return list(self.tokenizer(self.render_chat(messages), add_special_tokens=False)["input_ids"])

    def make_spec(self, **spec_kwargs: Any) -> OutputSpec | None:
        if all(spec_kwargs.get(k) is None for k in _SPEC_KEYS):
            return None
        from .grammar.spec import make_output_spec

        return make_output_spec(**spec_kwargs)

    def _split_specs(self, n: int, spec_args: dict[str, Any]) -> tuple[list[dict[str, Any]], bool]:
        """One spec for all prompts, or one per prompt (a list of length n for a spec argument)."""
        per_prompt = {}
        for k in _SPEC_KEYS:
            v = spec_args.get(k)
            is_list = _per_prompt(k, v)
            if is_list and len(v) != n:
                raise GrammarError(f"{k}: a list gives one spec per prompt; got {len(v)} for {n} prompts")
            if is_list:
                per_prompt[k] = v
        if not per_prompt:
            return [spec_args] * n, False
        out = []
        for i in range(n):
            d = dict(spec_args)
            for k, v in per_prompt.items():
                d[k] = v[i]
            out.append(d)
        return out, True

    def _new_request(
        self,
        ids: list[int],
        params: SamplingParams,
        spec: OutputSpec | None,
        index: int,
        backend: str | None,
        sample: int = 0,
    ) -> Request:
        if len(ids) == 0:
            raise ValueError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens; the model's context (or the KV pool) holds {self.max_model_len}"
            )
        seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        if sample:  # sample 0 keeps the seed: with n=1 the same seed gives the same output
            seed = step_seed(seed, -sample)
        r = Request(prompt_ids=ids, params=params, spec=spec, seed=seed, index=index)
        if params.prompt_logprobs is not None and sample == 0:  # the samples share one prompt
            r.prompt_logprobs = [None]
        if spec is not None:
            r.grammar = GrammarState(future=self.grammar.compile_async(spec, backend, params.compile_timeout_s))
        return r

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
        single = isinstance(prompts, str)
        return self._run(
            [prompts] if single else list(prompts),
            params,
            chat=False,
            progress=progress,
            raise_on_error=raise_on_error,
            spec_kwargs=spec_kwargs,
            single=single,
        )

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
        items, single = split_chat_messages(messages)
        return self._run(
            items,
            params,
            chat=True,
            progress=progress,
            raise_on_error=raise_on_error,
            spec_kwargs=spec_kwargs,
            single=single,
        )

    @staticmethod
    def _spec_args(spec_kwargs: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
        """(grammar_backend, the output-spec arguments); unknown keywords raise TypeError."""
        spec_kwargs = dict(spec_kwargs)
        backend = spec_kwargs.pop("grammar_backend", None)
        if backend is not None and backend not in ("llguidance", "xgrammar"):
            raise ValueError(f"grammar_backend must be 'llguidance' or 'xgrammar', got {backend!r}")
        spec_args = {
            k: spec_kwargs.pop(k)
            for k in list(spec_kwargs)
            if k in _SPEC_KEYS or k in ("grammar_syntax", "json_whitespace", "strict")
        }
        if spec_kwargs:
            raise TypeError(f"unexpected keyword arguments: {sorted(spec_kwargs)}")
        return backend, spec_args

    def _run(
        self,
        items: list[Any],
        params: ParamsArg,
        *,
        chat: bool,
        progress: bool,
        raise_on_error: bool,
        spec_kwargs: dict[str, Any],
        single: bool,
    ) -> list[Result]:
        return list(
            self._iter(
                items,
                params,
                chat=chat,
                progress=progress,
                raise_on_error=raise_on_error,
                spec_kwargs=spec_kwargs,
                single=single,
                max_in_flight=None,
                total=len(items),
            )
        )

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
        return self._iter(
            prompts,
            params,
            chat=chat,
            progress=progress,
            raise_on_error=raise_on_error,
            spec_kwargs=spec_kwargs,
            single=False,
            max_in_flight=max_in_flight,
            total=None,
        )

    def _plan(self, items: Iterable[Any], params: ParamsArg, chat: bool, spec_kwargs: dict[str, Any]) -> "_CallPlan":
        """What every item of one call shares: its params, its spec(s), the grammar backend.
        A bad shared spec raises here, before any model work."""
        params_at = self._params_per_item(items, params)
        backend, spec_args = self._spec_args(spec_kwargs)
        if isinstance(items, list):
            per_item_specs, per_prompt = self._split_specs(len(items), spec_args)
        else:
            per_item_specs, per_prompt = [], False
            if any(_per_prompt(k, spec_args.get(k)) for k in _SPEC_KEYS):
                raise TypeError("a list of specs (one per prompt) needs a list of prompts, not an iterator")
        shared_spec = None
        if not per_prompt:
            shared_spec = self.make_spec(**spec_args)  # a bad shared spec raises here
            if shared_spec is not None:
                # ... and fails before any model work (under the longest compile deadline asked for)
                timeouts = [
                    p.compile_timeout_s
                    for p in ([params] if not isinstance(params, (list, tuple)) else params)
                    if p is not None
                ]
                self.grammar.compile(shared_spec, backend, max(timeouts) if all(timeouts) and timeouts else None)
        return _CallPlan(params_at, backend, per_item_specs, per_prompt, shared_spec, chat)

    def _requests_for(self, plan: "_CallPlan", i: int, item: Any) -> list[Request]:
        """The request(s) of item i of a call: one, or n for SamplingParams(n). A problem of
        this item alone (too long, a bad per-item spec) raises ValueError/TypeError."""
        spec = self.make_spec(**plan.per_item_specs[i]) if plan.per_prompt else plan.shared_spec
        ids = self.encode_chat(item) if plan.chat else self._encode_raw(item)
        p = plan.params_at(i)
        return [self._new_request(ids, p, spec, i, plan.backend, j) for j in range(p.n)]

    def _iter(
        self,
        items: Iterable[Any],
        params: ParamsArg,
        *,
        chat: bool,
        progress: bool,
        raise_on_error: bool,
        spec_kwargs: dict[str, Any],
        single: bool,
        max_in_flight: int | None,
        total: int | None,
    ) -> Iterator[Result]:
        plan = self._plan(items, params, chat, spec_kwargs)
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, desc="generate", unit="req")
        pending: deque[tuple[int, Any, Request | Result]] = deque()
        limit = max_in_flight or (1 << 62)
        in_flight = 0  # entries not handed back, weighed in requests: n for a prompt sampled n times
        it = iter(enumerate(items))
        exhausted = False
        try:
            while True:
                while not exhausted and in_flight < limit:
                    nxt = next(it, None)
                    if nxt is None:
                        exhausted = True
                        break
                    i, item = nxt
                    try:
                        group = self._requests_for(plan, i, item)
                    except (ValueError, TypeError) as e:
                        if single or raise_on_error:
                            raise
                        pending.append((i, item, outputs.error_result(i, e, item)))
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
                    res = self._hand_back(x, item, raise_on_error)
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

    @staticmethod
    def _params_per_item(items: Iterable[Any], params: ParamsArg) -> Callable[[int], SamplingParams]:
        """params: None, one SamplingParams, or one per item (needs a list of items)."""
        if params is None or isinstance(params, SamplingParams):
            shared = params or SamplingParams()
            shared.validate()  # again: a field may have been changed since construction
            return lambda i: shared
        if not isinstance(params, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in params):
            raise TypeError(f"params must be a SamplingParams or a list of them, got {type(params).__name__}")
        if not isinstance(items, list):
            raise TypeError("a list of SamplingParams needs a list of prompts (one per prompt)")
        if len(params) != len(items):
            raise ValueError(f"got {len(params)} SamplingParams for {len(items)} prompts; pass one, or one per prompt")
        for p in params:
            p.validate()
        return params.__getitem__

    def _encode_raw(self, item: Any) -> list[int]:
        if isinstance(item, str):
            return self.encode_prompt(item)
        if isinstance(item, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            bad = next((t for t in item if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"token id {bad} is outside the model's vocabulary (0 to {self.vocab_size - 1})")
            return list(item)  # pre-tokenized prompt
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(item).__name__}")

    # ------------------------------------------------------------------ streaming and conversations
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
        from .partial import PartialObjects

        objects = PartialObjects(r.spec.python_type)
        for delta in self._stream(r):
            obj = objects.feed(delta)
            if obj is not None:
                yield obj
        result = self._hand_back(r, prompt, False)
        if result.error is not None:
            raise OutputError(
                f"the streamed output is not a complete valid object: {result.error_type}: {result.error}"
            )
        yield result.parsed if r.spec.python_type is not None else result.json

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

    def conversation(self, system: str | None = None, params: SamplingParams | None = None) -> Conversation:
        from .conversation import Conversation

        return Conversation(self, system=system, params=params)
