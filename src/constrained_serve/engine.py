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
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from .batch import Batch
from .cache.manager import KVCacheManager
from .detokenizer import IncrementalDetokenizer, batch_decoder
from .interrupts import sigint_deferred
from .request import Request
from .runner import ModelRunner
from .sampler import Sampler, record_prompt_logprobs
from .scheduler import Scheduler
from .stop_strings import forced_until_stop, stop_string_seen

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from .grammar.manager import GrammarManager

logger = logging.getLogger(__name__)


class EngineCore:
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
        self.sampler = Sampler(runner.device)
        self._decode = batch_decoder(tokenizer)
        self.device = runner.device
        self.num_steps = 0
        self.check_each_step = False  # tests turn this on: integrity check after every step
        self.finished_queue: list[Request] = []
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
        r.detok = IncrementalDetokenizer(self.tokenizer, r.prompt_ids[-4:])
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
        r.error, r.error_type = error, error_type
        self.scheduler.finish(r, reason)
        self.finished_queue.append(r)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------ grammar
    def _prepare_grammars(self) -> None:
        """Give waiting requests whose grammar finished compiling a matcher (or their error),
        and append the tokens their grammar forces before the first sampled one."""
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
        if not ready:
            return
        # Tokens the grammar forces before the first sampled token join the prefill.
        results = self.grammar.advance([(r.matcher, [], self._ff_room(r), r.params.stop_token_ids) for r in ready])
        for r, res in zip(ready, results):
            if res is None:
                self._abort(r, "abort", self._backend_failure(r, r.matcher.failure), "GrammarError")
                continue
            if not self._check_stop(r, [], res.finished_first):
                [forced] = self._append_forced([(r, res.forced)])
                self._check_stop(r, forced, res.finished)

    def _ff_room(self, r: Request, last: int | None = None) -> int:
        """How many forced tokens r may take now (0: fast-forward off, or ``last``, the token
        just sampled, ends the request anyway)."""
        if not self.fast_forward or (
            last is not None
            and (last in r.params.stop_token_ids or (not r.params.ignore_eos and last in self.eos_token_ids))
        ):
            return 0
        return max(0, min(r.params.max_tokens - r.num_output, self.max_model_len - r.num_tokens))

    def _append_forced(self, rows: list[tuple[Request, list[int]]]) -> list[list[int]]:
        """Append the tokens the grammar forced to each request (the worker cut them at the
        room left and after a stop token); returns what each got. A stop string cuts them
        where it completes."""
        out, emits = [], []
        for r, forced in rows:
            if r.params.stop and forced:  # the token that completes a stop string ends them
                forced = forced[: forced_until_stop(r, forced)]
            out.append(forced)
            if not forced:
                continue
            r.token_ids.extend(forced)
            if r.logprobs is not None:  # never sampled, so never scored: fast_forward=False scores them
                r.logprobs.extend([None] * len(forced))
            r.num_forced += len(forced)
            if forced[-1] in r.params.stop_token_ids:  # the stop token on its own: its text is left out
                self._emit_many([(r, forced[:-1])])
                self._emit_many([(r, forced[-1:])])
            else:
                emits.append((r, forced))
        self._emit_many(emits)
        return out

    # ------------------------------------------------------------------ the step
    def step(self) -> list[Request]:
        """Run one step; return the requests that finished during it. Ctrl-C waits for the
        step to end (interrupts.py), and aborts asked for during the step apply after it."""
        with sigint_deferred(interrupt_on_second=True):
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
        if self.grammar is not None:
            self.grammar.abandon_all()  # every matcher is rebuilt from its history when next used
        why = "interrupted by a second Ctrl-C in the middle of a step"
        for r in self.scheduler.drop_all():
            r.finish_reason, r.error, r.error_type = "abort", why, "KeyboardInterrupt"
            self.finished_queue.append(r)
        # The conversations keep their history; their next turn recomputes its KV.
        self.kv.reset()  # their pins too
        logger.warning("%s: every unfinished request failed, the KV cache was cleared", why)

    def _step(self) -> None:
        if self.grammar is not None:
            self._prepare_grammars()
        batch = self.scheduler.schedule()
        if not batch:
            if self.scheduler.running or self._only_compiling():
                return
            # Nothing schedulable and nothing compiling: a waiting request can never fit.
            for r in list(self.scheduler.waiting):
                self._abort(r, "abort", "request does not fit in the KV cache", "PromptTooLongError")
            return
        inputs = self.runner.prepare(batch)
        sampling = batch.sampling_chunks
        reqs = [c.request for c in sampling]
        rows = [(i, r.matcher) for i, r in enumerate(reqs) if r.matcher is not None]
        bitmask = self.grammar.step_bitmask(len(reqs)) if rows else None
        if self.overlap:
            # The mask workers fill the rows while the forward runs (on CUDA it is only
            # launched here; on CPU this thread runs it and the workers use the other cores).
            self._masks = self.grammar.fill_bitmask_async(rows, bitmask) if rows else None
            logits = self.runner.forward(inputs)
        else:
            logits = self.runner.forward(inputs)
            self._masks = self.grammar.fill_bitmask_async(rows, bitmask) if rows else None
        if self._masks is not None:
            masks, self._masks = self._masks, None
            masks.wait()  # a row whose grammar work failed allows every token; _update fails it
        if inputs.prompt_rows:  # after the sampling rows; scored before penalties touch logits
            record_prompt_logprobs(logits[len(reqs) :], inputs.prompt_rows)
            logits = logits[: len(reqs)]
        tokens, logprobs = self.sampler.sample(logits, reqs, bitmask) if reqs else ([], None)
        self._update(batch, tokens, logprobs)
        self.num_steps += 1
        if self.check_each_step:
            self.check_integrity()

    def _only_compiling(self) -> bool:
        """Waiting requests whose grammar is not attached yet (compiling, or just done)."""
        return any(r.compiling for r in self.scheduler.waiting)

    def drain_finished(self) -> list[Request]:
        done, self.finished_queue = self.finished_queue, []
        for r in done:
            if r.matcher is not None:  # its worker drops the matcher; the handle keeps its last state
                self.grammar.release(r.matcher)
        return done

    def _update(self, batch: Batch, tokens: list[int], logprobs: list | None = None) -> None:
        ps = self.kv.page_size
        for c in batch.chunks:
            r = c.request
            r.num_computed += c.num_new
            if r.num_computed // ps > (r.num_computed - c.num_new) // ps:
                # A page completed (by a prefill chunk or a decode step): publish it to the
                # prefix cache now, not at finish, so requests that wait on the same prefix
                # (Scheduler._prefix_in_flight) reuse it next step.
                self.kv.share_progress(r)
        plain: list[tuple[Request, int]] = []
        constrained: list[tuple[Request, int]] = []
        for j, (c, tok) in enumerate(zip(batch.sampling_chunks, tokens)):
            r = c.request
            r.token_ids.append(tok)
            if r.logprobs is not None:
                r.logprobs.append(logprobs[j] if logprobs is not None else None)
            (constrained if r.matcher is not None else plain).append((r, tok))
        # One round trip for every constrained row: accept the sampled token, then take the
        # tokens the grammar forces next (unless the token ends the request anyway).
        results = (
            self.grammar.advance(
                [(r.matcher, [tok], self._ff_room(r, tok), r.params.stop_token_ids) for r, tok in constrained]
            )
            if constrained
            else []
        )
        emits = [(r, [tok]) for r, tok in plain]
        kept = []
        for (r, tok), res in zip(constrained, results):
            if res is None:
                # Its grammar work failed this step (a deadline, a crash, a parser limit, or a
                # mask that allowed nothing): the token was drawn without a mask, so it goes.
                r.token_ids.pop()
                if r.logprobs is not None:
                    r.logprobs.pop()
                why = (
                    self._rejection_message(r, r.num_output)
                    if r.matcher.dead_end
                    else self._backend_failure(r, r.matcher.failure)
                )
                self._abort(r, "abort", why, "GrammarError")
                continue
            emits.append((r, [tok]))
            kept.append((r, tok, res))
        self._emit_many(emits)  # one batched detokenization for the whole step
        for r, tok in plain:
            self._check_stop(r, [tok])
        forced_rows = []
        for r, tok, res in kept:
            if not res.accepted:  # a dead end in the spec: its mask allowed only what it refuses
                why = (
                    self._rejection_message(r, r.num_output - 1)
                    if res.dead_end
                    else f"grammar rejected sampled token {tok}, which its own mask allowed"
                )
                self._abort(r, "abort", why, "GrammarError")
            elif not self._check_stop(r, [tok], res.finished_first):
                forced_rows.append((r, res))
        appended = self._append_forced([(r, res.forced) for r, res in forced_rows])
        for (r, res), forced in zip(forced_rows, appended):
            if forced or res.finished:  # else nothing changed since the check above
                self._check_stop(r, forced, res.finished)
        if self.overlap and forced_rows:
            # The next step's masks of the requests that go on, computed by the mask workers
            # from now on, while this thread finishes the step and prepares the next one.
            self.grammar.prefill_masks([r.matcher for r, _ in forced_rows if not r.finished])

    @staticmethod
    def _rejection_message(r: Request, n_output: int) -> str:
        """A dead end in the spec (a grammar that matches nothing from here on): its mask
        allowed only EOS, which it does not accept, or nothing at all."""
        kind = r.spec.kind if r.spec is not None else "grammar"
        return (
            f"the {kind} spec allows no token after {n_output} output tokens "
            f"({r.detok.text[-40:]!r}) and does not accept them: it cannot be completed"
        )

    @staticmethod
    def _backend_failure(r: Request, reason: str) -> str:
        return (
            f"{r.matcher.backend_name} failed after {r.num_output} output tokens "
            f"({r.detok.text[-40:]!r}): {reason}; the output is incomplete"
        )

    def _emit_many(self, rows: list[tuple[Request, list[int]]]) -> None:
        """Push each request's new tokens through its detokenizer (one batched decode for all
        of them): stop strings are matched on that text, and Engine.stream reads it."""
        items = []
        for r, toks in rows:
            r.text_mark = len(r.detok.text)
            items.append((r.detok, toks))
        if items:
            IncrementalDetokenizer.push_many(items, self._decode)

    def _check_stop(self, r: Request, new: list[int], grammar_finished: bool = False) -> bool:
        """End r if ``new`` (the tokens just appended) or ``grammar_finished`` (its grammar
        allows nothing more) ends it; True if it ended (or already had)."""
        if r.finished:
            return True
        p = r.params
        reason = None
        if new and not p.ignore_eos and new[-1] in self.eos_token_ids:
            reason = "stop"
        elif new and new[-1] in p.stop_token_ids:
            reason, r.stop_reason = "stop", new[-1]
            r.text_end = r.text_mark  # the stop token's text is not part of the output
        elif p.stop and (seen := stop_string_seen(r)) is not None:
            # Before the grammar's end: a stop string in the closing text (a "}") cuts it.
            reason, r.stop_reason = "stop", seen
        elif grammar_finished:
            reason = "stop"
        elif r.num_output >= p.max_tokens or r.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is None:
            return False
        self.scheduler.finish(r, reason)
        self.finished_queue.append(r)
        return True

    # ------------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        self.kv.check_integrity(list(self.scheduler.running))
