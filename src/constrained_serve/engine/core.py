"""The step loop: schedule -> forward (overlapped with grammar masks) -> sample -> update.

``EngineCore`` knows nothing about prompts, chat templates or result formatting (that is
``api.Engine``); it takes ``Request`` objects and advances them one step at a time.

Grammar work (matchers, masks, forced tokens) runs in the grammar manager's worker processes,
under deadlines (grammar/manager.py): two round trips per step, one to fill the step's mask
rows and one to accept the sampled tokens and take the forced ones.

Overlap: the grammar bitmask rows for step N's sampling rows are filled while the forward of
step N runs: the fill is sent to the mask workers before the forward and collected after it.
On CUDA the forward launch is asynchronous; on CPU this thread runs the forward, so every torch
op of a step runs on one OS thread, hence one OpenMP team (a forward in a helper thread gave
libgomp two teams contending for the cores, 2.5x slower on 2 cores), while the workers fill
masks in their own processes. ``overlap=False`` sends the fill after the forward: it is the
reference the overlapped loop must match token for token.

Pipelining (``pipeline=True``, the default on CUDA): a step's tokens are read on the host only
after the next step's forward is launched. The next step is scheduled with a placeholder for
each token not read yet (``Request.pending_row``); its inputs take them from the device
tensor of sampled ids. While the GPU runs step N+1's forward, this thread reads step N's
tokens, advances their grammars (the mask workers then fill step N+1's masks), detokenizes
and checks stops, so host work no longer sits between two forwards (SGLang's overlap
scheduler, vLLM's async scheduling). The cost: a request that step N ends, or whose grammar
forces tokens after it, has a row in step N+1 whose token is thrown away (its forced tokens
run in step N+2). A row whose token surely ends its request by length gets no placeholder and
is not scheduled again. On CPU the forward is synchronous, so there is nothing to overlap:
the loop is off there unless asked for (tests check it against the plain loop).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..cache.manager import KVCacheManager
from ..runtime.runner import ModelRunner
from ..runtime.sampler import SampledTokens, Sampler, record_prompt_logprobs
from .batch import Batch
from .detokenizer import IncrementalDetokenizer, batch_decoder
from .interrupts import first_press_interrupts, sigint_deferred
from .request import OutputText, Request
from .scheduler import Scheduler
from .step_update import StepUpdater

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from ..grammar.manager import GrammarManager

logger = logging.getLogger(__name__)

# In token_ids where a sampled token is not read from the device yet (pipelined loop): never
# a token id, so nothing that compares token lists mistakes it for one.
PLACEHOLDER = -1


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off for one step. A step of 256 rows allocates tens of
    thousands of short-lived objects (lists, tuples, ids), and the collections they set off
    took ~0.6 ms of a 5 ms step (host_overhead.py, 256 JSON rows: 4.5 vs 5.1 ms). Reference
    counting frees them anyway; the collector runs at the first allocation after the step."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are queued on the device; ``_finish`` reads its
    tokens (at once, or, pipelined, after the next step's forward is launched)."""

    batch: Batch
    requests: list[Request]  # of the sampling rows
    sampled: SampledTokens | None  # None: no row samples
    # Rows whose token goes on its request: False where, by the time the row was sampled,
    # the request had ended or its grammar had forced tokens past the row's position.
    valid: list[bool]


class EngineCore:
    """The step loop. It holds the scheduler, the KV cache manager, the runner and the
    sampler, and a ``StepUpdater`` (step_update.py) that applies each step's tokens to its
    requests; ``eos_token_ids``, ``max_model_len``, ``overlap`` and ``fast_forward`` are fixed
    at construction (the updater has them too)."""

    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        kv: KVCacheManager,
        tokenizer: PreTrainedTokenizerBase,
        eos_token_ids: set[int],
        max_model_len: int,
        make_grammar: "Callable[[], GrammarManager] | None" = None,
        overlap: bool = True,
        fast_forward: bool = True,
        pipeline: bool = False,
    ) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.kv = kv
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        # The GrammarManager, made by grammar_manager() when the first spec arrives: None
        # while no request has asked for one (the steps skip grammar work then).
        self.grammar: "GrammarManager | None" = None
        self._make_grammar = make_grammar
        self._grammar_lock = threading.Lock()
        self.overlap = overlap
        self.fast_forward = fast_forward
        self.pipeline = pipeline
        self._launched: LaunchedStep | None = None  # pipelined: the step whose tokens are not read yet
        self.sampler = Sampler(runner.device)
        self.device = runner.device
        self.num_steps = 0
        self.check_each_step = False  # tests turn this on: integrity check after every step
        self._finished: list[Request] = []  # ended since the last drain_finished (never rebound)
        self.updater = StepUpdater(
            scheduler,
            kv,
            self.grammar_manager,
            batch_decoder(tokenizer),
            eos_token_ids,
            max_model_len,
            fast_forward=fast_forward,
            overlap=overlap,
            finished=self._finished.append,
            abort=self._abort,
        )
        self._in_step = False
        self._masks = None  # PendingMasks: the mask fill of the step running
        self._deferred_aborts: list[tuple] = []

    def grammar_manager(self) -> "GrammarManager":
        """The GrammarManager, made on first use (its token tables take a moment)."""
        if self.grammar is None:
            with self._grammar_lock:
                if self.grammar is None:
                    if self._make_grammar is None:
                        raise RuntimeError("this EngineCore was built without grammar support (make_grammar)")
                    self.grammar = self._make_grammar()  # published whole: other threads see it complete
        return self.grammar

    # ------------------------------------------------------------------ requests
    def add(self, r: Request) -> None:
        r.text_state = OutputText(IncrementalDetokenizer(self.tokenizer, r.prompt_ids[-4:]))
        self.scheduler.add(r)

    def abort(self, r: Request, reason: str = "abort", error: str | None = None, error_type: str | None = None) -> None:
        """End r now (from the API: a caller that stopped early, an error)."""
        if self._in_step:
            # Called from inside a step (a generator finalised by the garbage collector
            # during the forward): freeing r's pages now would pull them from under the
            # step. It happens when the step is done.
            self._deferred_aborts.append((r, reason, error, error_type))
            return
        with sigint_deferred():  # half-released pages would stay lost
            self._abort(r, reason, error, error_type)

    def _abort(
        self, r: Request, reason: str = "abort", error: str | None = None, error_type: str | None = None
    ) -> None:
        if r.finished:
            return
        self._drop_placeholder(r)
        r.error, r.error_type = error, error_type
        self.scheduler.finish(r, reason)
        self._finished.append(r)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._launched is not None

    @property
    def awaiting_tokens(self) -> bool:
        """A launched step's tokens are not read yet (pipelined loop): the next step reads them."""
        return self._launched is not None

    @staticmethod
    def _drop_placeholder(r: Request) -> None:
        """Forget the token r waits for from the launched step (r ends before it is read)."""
        if r.pending_row is not None:
            r.token_ids.pop()
            r.pending_row = None

    # ------------------------------------------------------------------ grammar
    def _prepare_grammars(self) -> None:
        """Give waiting requests whose grammar finished compiling a matcher (or their error),
        and append the tokens their grammar forces before the first sampled one (the updater)."""
        ready = []
        for r in list(self.scheduler.waiting):
            g = r.grammar
            if g is None or g.future is None or not g.future.done():
                continue
            try:
                compiled = g.future.result()
            except Exception as e:  # noqa: BLE001 - the request fails alone, with the reason
                self._abort(r, "abort", str(e), type(e).__name__)
                continue
            g.compiled, g.future = compiled, None
            g.matcher = self.grammar.new_matcher(compiled, r.params.mask_timeout_s)
            ready.append(r)
        if ready:
            self.updater.take_first_forced(ready)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[Request]:
        """Run one step; return the requests that finished during it. Ctrl-C waits for the
        step to end (interrupts.py), and aborts asked for during the step apply after it."""
        with sigint_deferred(interrupt_on_second=True), _gc_paused():
            if self.kv.pins is not None:
                self.kv.pins.release_orphans()  # of conversations collected without close()
            self._in_step = True
            try:
                self._step()
            except KeyboardInterrupt:
                # Only a second Ctrl-C gets here (the first waits for the step's end): the
                # step stopped anywhere, so no request's state can be trusted.
                self._recover_from_broken_step()
                raise
            finally:
                self._in_step = False
                deferred, self._deferred_aborts = self._deferred_aborts, []
                for args in deferred:
                    self._abort(*args)
        return self.drain_finished()

    def _recover_from_broken_step(self) -> None:
        """Fail every unfinished request and forget the whole KV cache (pages, prefix cache,
        conversation pins), so that the engine serves the next call correctly. Conversations
        keep their history; their next turn recomputes it."""
        if self._masks is not None:  # a fill still running in the mask workers: their state is lost
            self._masks.abandon()
            self._masks = None
        self._launched = None
        if self.grammar is not None:
            self.grammar.abandon_all()  # every matcher is rebuilt from its history when next used
        planned = first_press_interrupts()  # the caller stops at Ctrl-C: nothing to warn about
        why = f"interrupted by {'Ctrl-C' if planned else 'a second Ctrl-C'} in the middle of a step"
        for r in self.scheduler.drop_all():
            self._drop_placeholder(r)
            r.finish_reason, r.error, r.error_type = "abort", why, "KeyboardInterrupt"
            self._finished.append(r)
        # The conversations keep their history; their next turn recomputes its KV.
        self.kv.reset()  # their pins too
        log = logger.debug if planned else logger.warning
        log("%s: every unfinished request failed, the KV cache was cleared", why)

    def _step(self) -> None:
        if self.grammar is not None:
            self._prepare_grammars()
        prev = self._launched  # kept until read: a step that fails before that leaves it for the next
        batch = self.scheduler.schedule()
        if not batch:
            if prev is not None:
                self._finish(prev)
                return
            if self.scheduler.running or self._only_compiling():
                return
            # Nothing schedulable and nothing compiling: a waiting request can never fit.
            for r in list(self.scheduler.waiting):
                self._abort(r, "abort", "request does not fit in the KV cache", "PromptTooLongError")
            return
        prev_tokens = prev.sampled.tokens if prev is not None and prev.sampled is not None else None
        inputs = self.runner.prepare(batch, prev_tokens)
        reqs = [c.request for c in batch.sampling_chunks]
        # The mask workers fill the rows while the forward runs (on CUDA it is only launched
        # here; on CPU this thread runs it and the workers use the other cores). Pipelined,
        # the matchers first take the previous step's tokens: the fill starts after that.
        early = self.overlap and prev is None
        bitmask = self._start_masks(reqs, None) if early else None
        logits = self.runner.forward(inputs)
        if prev is not None:
            self._finish(prev)  # on CUDA, while the GPU runs this step's forward
        self.updater.account(batch)
        valid = [not r.finished and r.num_pending == 0 for r in reqs]
        if not early:
            bitmask = self._start_masks(reqs, valid)
        if self._masks is not None:
            masks, self._masks = self._masks, None
            masks.wait()  # a row whose grammar work failed allows every token; take_tokens fails it
        if inputs.prompt_rows:  # after the sampling rows; scored before penalties touch logits
            record_prompt_logprobs(logits[len(reqs) :], inputs.prompt_rows)
            logits = logits[: len(reqs)]
        step = LaunchedStep(batch, reqs, self.sampler.launch(logits, reqs, bitmask) if reqs else None, valid)
        self.num_steps += 1
        if not self.pipeline:
            self._finish(step)
        elif any(valid):  # else every token of it would be thrown away: nothing to read
            for j, r in enumerate(reqs):
                if valid[j] and not self._ends_by_length(r):
                    r.token_ids.append(PLACEHOLDER)
                    r.pending_row = j
            self._launched = step
        if self.check_each_step:
            self.check_integrity()

    def _start_masks(self, reqs: list[Request], valid: list[bool] | None) -> "torch.Tensor | None":
        """The step's bitmask (every bit set), its constrained rows sent to the mask workers
        (``self._masks``; rows not ``valid`` stay all set: their tokens are thrown away)."""
        rows = [(i, r.matcher) for i, r in enumerate(reqs) if r.matcher is not None and (valid is None or valid[i])]
        if not rows:
            return None
        bitmask = self.grammar.step_bitmask(len(reqs))
        self._masks = self.grammar.fill_bitmask_async(rows, bitmask)
        return bitmask

    def _ends_by_length(self, r: Request) -> bool:
        """Will r's next token end it by max_tokens or the context length?"""
        return r.num_output + 1 >= r.params.max_tokens or r.num_tokens + 1 >= self.max_model_len

    def _finish(self, step: LaunchedStep) -> None:
        """Read a launched step's tokens (waiting for the device) and update their requests."""
        if step is self._launched:
            self._launched = None
        if step.sampled is None:
            return
        tokens, logprobs = step.sampled.result()
        rows = []
        for j, r in enumerate(step.requests):
            if not step.valid[j] or r.finished:  # aborted since it was launched: its placeholder went then
                continue
            self._drop_placeholder(r)  # the token goes in its place
            rows.append((r, tokens[j], logprobs[j] if logprobs is not None else None))
        self.updater.take_tokens(rows)

    def _only_compiling(self) -> bool:
        """Waiting requests whose grammar is not attached yet (compiling, or just done)."""
        return any(r.compiling for r in self.scheduler.waiting)

    def drain_finished(self) -> list[Request]:
        """The requests that ended since the last call; the runner and the grammar workers
        forget them."""
        done = list(self._finished)
        self._finished.clear()
        for r in done:
            self.runner.release(r)
            if r.matcher is not None:  # its worker drops the matcher; the handle keeps its last state
                self.grammar.release(r.matcher)
        return done

    # ------------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        self.kv.check_integrity(list(self.scheduler.running))
