"""What a step's sampled tokens do to their requests: append them, advance the grammars
(accept the token, take the tokens the grammar forces next), detokenize, check stops.

A part of ``EngineCore`` (engine.py), as ``GrammarMasks`` is of the grammar manager: the step
loop lives there, this is the update at its end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .batch import Batch
from .detokenizer import IncrementalDetokenizer
from .request import Request
from .stop_strings import forced_until_stop, stop_string_seen

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..cache.manager import KVCacheManager
    from ..grammar.manager import GrammarManager
    from .scheduler import Scheduler


class StepUpdates:
    # EngineCore's, used here
    scheduler: "Scheduler"
    kv: "KVCacheManager"
    grammar: "GrammarManager | None"
    eos_token_ids: set[int]
    max_model_len: int
    overlap: bool
    fast_forward: bool
    finished_queue: list[Request]
    _decode: "Callable"
    _abort: "Callable[..., None]"

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

    def _account(self, batch: Batch) -> None:
        """The step's chunks are computed (or queued on the device, ahead of anything that
        reads them): count them, and publish the pages they completed."""
        ps = self.kv.page_size
        for c in batch.chunks:
            r = c.request
            if r.finished:  # ended by the previous step's tokens (pipelined loop): pages gone
                continue
            r.num_computed += c.num_new
            if r.num_computed // ps > (r.num_computed - c.num_new) // ps:
                # A page completed (by a prefill chunk or a decode step): publish it to the
                # prefix cache now, not at finish, so requests that wait on the same prefix
                # (Scheduler._prefix_in_flight) reuse it next step.
                self.kv.share_progress(r)

    def _take_tokens(self, rows: list[tuple[Request, int, dict[int, float] | None]]) -> None:
        """Append each row's sampled token (with its logprobs entry) to its request, then
        advance the grammars, detokenize and check stops."""
        plain: list[tuple[Request, int]] = []
        constrained: list[tuple[Request, int]] = []
        for r, tok, lp in rows:
            r.token_ids.append(tok)
            if r.logprobs is not None:
                r.logprobs.append(lp)
            (constrained if r.matcher is not None else plain).append((r, tok))
        # One round trip for every constrained row: accept the sampled token, then take the
        # tokens the grammar forces next (unless the token ends the request anyway). The
        # workers run it while this thread detokenizes every row (one batched decode); a row
        # whose grammar work fails gets its text taken back.
        pending = (
            self.grammar.advance_async(
                [(r.matcher, [tok], self._ff_room(r, tok), r.params.stop_token_ids) for r, tok in constrained]
            )
            if constrained
            else None
        )
        marks = [r.detok.mark() for r, _ in constrained]
        self._emit_many([(r, [tok]) for r, tok in plain] + [(r, [tok]) for r, tok in constrained])
        results = pending.result() if pending is not None else []
        kept = []
        for (r, tok), res, mark in zip(constrained, results, marks):
            if res is None:
                # Its grammar work failed this step (a deadline, a crash, a parser limit, or a
                # mask that allowed nothing): the token was drawn without a mask, so it goes.
                r.token_ids.pop()
                r.detok.restore(mark)
                if r.logprobs is not None:
                    r.logprobs.pop()
                why = (
                    self._rejection_message(r, r.num_output)
                    if r.matcher.dead_end
                    else self._backend_failure(r, r.matcher.failure)
                )
                self._abort(r, "abort", why, "GrammarError")
                continue
            kept.append((r, tok, res))
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
