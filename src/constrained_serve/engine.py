"""The step loop: schedule -> forward (overlapped with grammar masks) -> sample -> update.

``EngineCore`` knows nothing about prompts, chat templates or result formatting (that is
``api.Engine``); it takes ``Request`` objects and advances them one step at a time.

Overlap: the grammar bitmask rows for step N's sampling rows are filled while the forward of
step N runs. On CUDA the forward launch is asynchronous and the caller thread fills the masks
after it. On CPU a helper thread fills the masks (llguidance and xgrammar release the GIL and
use no torch ops) while the caller thread runs the forward: every torch op of a step then runs
on one OS thread, hence one OpenMP team. The other way round (forward in a worker thread) gave
libgomp two teams contending for the cores, and the forward took 2.5x longer on 2 cores.
``overlap=False`` runs the same work strictly in sequence: it is the reference the overlapped
loop must match token for token.
"""
from __future__ import annotations

import copy
import logging
import weakref
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from .cache.manager import KVCacheManager
from .detokenizer import IncrementalDetokenizer
from .interrupts import sigint_deferred
from .request import Request, Status
from .runner import Batch, ModelRunner
from .sampler import Sampler, record_prompt_logprobs
from .scheduler import Scheduler

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, kv: KVCacheManager, tokenizer,
                 eos_token_ids: set[int], max_model_len: int, grammar=None, overlap: bool = True,
                 fast_forward: bool = True) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.kv = kv
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.grammar = grammar  # GrammarManager (created lazily by the API)
        self.overlap = overlap
        self.fast_forward = fast_forward
        self.sampler = Sampler(runner.device)
        self.device = runner.device
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="masks") if self.device.type == "cpu" else None
        self.num_steps = 0
        self.check_each_step = False  # tests turn this on: integrity check after every step
        self.finished_queue: list[Request] = []
        # Open conversations pinning cached pages. Weak: a conversation the user dropped
        # without close() must not pin its history for good. Its pin comes back through
        # orphaned_pins (appended by a finalizer, on whatever thread the collector ran).
        self.page_holders: weakref.WeakSet = weakref.WeakSet()
        self.orphaned_pins: list = []
        self._in_step = False
        self._mask_future: Future | None = None  # the overlapped mask fill of the step running
        self._deferred_aborts: list[tuple] = []
        kv.release_pins = self._release_pins

    def release_pin(self, pin) -> None:
        """Give back a conversation's HistoryPin (radix lock and page refs); idempotent."""
        with sigint_deferred():  # an unlock without its decref would leak the pages
            if pin.node is not None:
                self.kv.radix.unlock(pin.node)
                self.kv.pool.decref(pin.pages)
            pin.forget()

    def _release_orphaned_pins(self) -> None:
        while self.orphaned_pins:
            self.release_pin(self.orphaned_pins.pop())

    def _release_pins(self) -> None:
        """Out of pages: unpin every open conversation's history (see KVCacheManager)."""
        self._release_orphaned_pins()
        pinned = [c for c in self.page_holders if c.pages]
        if pinned:
            logger.info("KV cache full: unpinning the history of %d open conversation(s)", len(pinned))
        for c in pinned:
            c.unpin()

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

    def _abort(self, r: Request, reason: str = "abort", error: str | None = None, error_type: str | None = None) -> None:
        if r.finished:
            return
        r.error, r.error_type = error, error_type
        self.scheduler.finish(r, reason)
        self.finished_queue.append(r)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------ grammar
    def _prepare_grammars(self) -> None:
        """Give waiting requests whose grammar finished compiling a matcher (or their error)."""
        for r in list(self.scheduler.waiting):
            fut = r.grammar_future
            if fut is None or r.matcher is not None or not fut.done():
                continue
            try:
                compiled = fut.result()
            except Exception as e:  # noqa: BLE001 - the request fails alone, with the reason
                self._abort(r, "abort", str(e), type(e).__name__)
                continue
            r.compiled, r.matcher = compiled, self.grammar.new_matcher(compiled)
            r.grammar_future = None
            # Tokens the grammar forces before the first sampled token join the prefill.
            if self._check_stop(r, self._fast_forward(r)):
                continue

    def _fast_forward(self, r: Request) -> list[int]:
        """Append the tokens the grammar forces next; returns them."""
        if not self.fast_forward or r.matcher is None or r.finished:
            return []
        room = min(r.params.max_tokens - r.num_output, self.max_model_len - r.num_tokens)
        forced = r.matcher.forced_tokens()[: max(room, 0)]
        # A stop token ends the output where it stands, as it would had it been sampled.
        cut = next((i for i, t in enumerate(forced) if t in r.params.stop_token_ids), None)
        if cut is not None:
            forced = forced[: cut + 1]
        if r.params.stop and forced:  # so does the token that completes a stop string
            forced = forced[: self._stop_string_end(r, forced)]
        if not forced:
            return []
        if not r.matcher.accept_tokens(forced):
            if (failed := r.matcher.error()) is not None:
                self._abort(r, "abort", self._backend_failure(r, failed), "GrammarError")
            else:
                logger.warning("grammar refused its own forced tokens %s", forced)
            return []
        r.token_ids.extend(forced)
        if r.logprobs is not None:  # never sampled, so never scored: fast_forward=False scores them
            r.logprobs.extend([None] * len(forced))
        r.num_forced += len(forced)
        if cut is not None:  # the stop token on its own, so that its text can be left out
            self._emit(r, forced[:-1])
            self._emit(r, forced[-1:])
        else:
            self._emit(r, forced)
        return forced

    # ------------------------------------------------------------------ the step
    def step(self) -> list[Request]:
        """Run one step; return the requests that finished during it. Ctrl-C waits for the
        step to end (interrupts.py), and aborts asked for during the step apply after it."""
        with sigint_deferred(interrupt_on_second=True):
            self._release_orphaned_pins()
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
        return self._drain()

    def _recover_from_broken_step(self) -> None:
        """Fail every unfinished request and forget the whole KV cache (pages, prefix cache,
        conversation pins), so that the engine serves the next call correctly. Conversations
        keep their history; their next turn recomputes it."""
        if self._mask_future is not None:
            wait([self._mask_future])  # the mask thread still reads the requests' matchers
        why = "interrupted by a second Ctrl-C in the middle of a step"
        for r in self.scheduler.drop_all():
            r.finish_reason, r.error, r.error_type = "abort", why, "KeyboardInterrupt"
            self.finished_queue.append(r)
        # The conversations keep their history; their next turn recomputes its KV.
        for pin in [c._pin for c in self.page_holders] + self.orphaned_pins:
            pin.forget()
        self.orphaned_pins.clear()
        self.kv.reset()
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
        if self.overlap and self._pool is not None:
            rows, bitmask = self._mask_rows(reqs)  # allocated here: torch ops stay on this thread
            fut = self._pool.submit(self.grammar.fill_bitmask, rows, bitmask) if rows else None
            self._mask_future = fut
            logits = self.runner.forward(inputs)
            if fut is not None:
                fut.result()
            self._mask_future = None
        else:
            logits = self.runner.forward(inputs)  # on CUDA: launched, not waited for
            bitmask = self._fill_masks(reqs)
        if inputs.prompt_rows:  # after the sampling rows; scored before penalties touch logits
            record_prompt_logprobs(logits[len(reqs):], inputs.prompt_rows)
            logits = logits[:len(reqs)]
        tokens, logprobs = self.sampler.sample(logits, reqs, bitmask) if reqs else ([], None)
        self._update(batch, tokens, logprobs)
        self.num_steps += 1
        if self.check_each_step:
            self.check_integrity()

    def _only_compiling(self) -> bool:
        """Waiting requests whose grammar is not attached yet (compiling, or just done)."""
        return any(r.grammar_future is not None for r in self.scheduler.waiting)

    def _drain(self) -> list[Request]:
        done, self.finished_queue = self.finished_queue, []
        return done

    def _mask_rows(self, reqs: list[Request]) -> tuple[list, torch.Tensor | None]:
        """The (row, matcher) pairs of constrained sampling rows, and a bitmask for all rows."""
        rows = [(i, r.matcher) for i, r in enumerate(reqs) if r.matcher is not None]
        return rows, (self.grammar.allocate_bitmask(len(reqs)) if rows else None)

    def _fill_masks(self, reqs: list[Request]) -> torch.Tensor | None:
        rows, bitmask = self._mask_rows(reqs)
        if rows:
            self.grammar.fill_bitmask(rows, bitmask)
        return bitmask

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
        for j, (c, tok) in enumerate(zip(batch.sampling_chunks, tokens)):
            r = c.request
            r.token_ids.append(tok)
            if r.logprobs is not None:
                r.logprobs.append(logprobs[j] if logprobs is not None else None)
            if r.matcher is not None and not r.matcher.accept_tokens([tok]):
                # A backend that failed (a parser limit, perhaps while computing this step's
                # mask) refuses every token and says why; otherwise a dead end in the spec.
                failed = r.matcher.error()
                why = self._backend_failure(r, failed) if failed else self._rejection_message(r, tok)
                self._emit(r, [tok])
                self._abort(r, "abort", why, "GrammarError")
                continue
            self._emit(r, [tok])
            if self._check_stop(r, [tok]):
                continue
            self._check_stop(r, self._fast_forward(r))

    def _rejection_message(self, r: Request, tok: int) -> str:
        """Why the matcher refused a token sampled under its own mask: usually a dead end in
        the spec (a grammar that matches nothing from here on), where the mask allowed only
        EOS. A refused token leaves the matcher's state as it was."""
        if self.grammar.backend(r.matcher.backend_name).dead_end(r.matcher):
            kind = r.spec.kind if r.spec is not None else "grammar"
            return (f"the {kind} spec allows no token after {r.num_output - 1} output tokens "
                    f"({r.detok.text[-40:]!r}) and does not accept them: it cannot be completed")
        return f"grammar rejected sampled token {tok}, which its own mask allowed"

    @staticmethod
    def _backend_failure(r: Request, reason: str) -> str:
        return (f"{r.matcher.backend_name} failed after {r.num_output} output tokens "
                f"({r.detok.text[-40:]!r}): {reason}; the output is incomplete")

    def _emit(self, r: Request, toks: list[int]) -> None:
        r.text_mark = len(r.detok.text)
        r.detok.push(toks)  # stop strings are matched on this text; Engine.stream reads it

    def _check_stop(self, r: Request, new: list[int]) -> bool:
        if r.finished:  # aborted by _fast_forward
            return True
        p = r.params
        reason = None
        if new and not p.ignore_eos and new[-1] in self.eos_token_ids:
            reason = "stop"
        elif new and new[-1] in p.stop_token_ids:
            reason, r.stop_reason = "stop", new[-1]
            r.text_end = r.text_mark  # the stop token's text is not part of the output
        elif p.stop and (seen := self._stop_string_seen(r)) is not None:
            # Before the grammar's end: a stop string in the closing text (a "}") cuts it.
            reason, r.stop_reason = "stop", seen
        elif r.matcher is not None and r.matcher.is_finished():
            reason = "stop"
        elif r.num_output >= p.max_tokens or r.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is None:
            return False
        self.scheduler.finish(r, reason)
        self.finished_queue.append(r)
        return True

    @staticmethod
    def _stop_string_end(r: Request, forced: list[int]) -> int:
        """How many of ``forced`` to append: up to the token whose text completes a stop
        string (all of them if none does), as had they been sampled one at a time."""
        detok = copy.copy(r.detok)
        detok.ids = list(detok.ids)
        start = EngineCore._stop_scan_start(r)
        for i, t in enumerate(forced):
            detok.push([t])
            if any(detok.text.find(s, start) >= 0 for s in r.params.stop):
                return i + 1
        return len(forced)

    @staticmethod
    def _stop_scan_start(r: Request) -> int:
        """Where a stop string could begin in text added since the last check: the scanned
        part minus enough for a stop string that straddles the boundary."""
        return max(0, r.stop_scanned - max(len(s) for s in r.params.stop) + 1)

    @staticmethod
    def _stop_string_seen(r: Request) -> str | None:
        """The stop string that occurs first in the text, or None. Searches only the text
        added since the last check, plus enough before it for a stop string that straddles
        the boundary (a fast-forward can add many characters at once)."""
        text = r.detok.text
        start = EngineCore._stop_scan_start(r)
        r.stop_scanned = len(text)
        found = [(i, s) for s in r.params.stop if (i := text.find(s, start)) >= 0]
        return min(found)[1] if found else None

    # ------------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        holders = list(self.scheduler.running) + [c._pin for c in self.page_holders]
        self.kv.check_integrity(holders + self.orphaned_pins)
