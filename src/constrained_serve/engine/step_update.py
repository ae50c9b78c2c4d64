"""What a step's sampled tokens do to their requests: append them, advance the grammars
(accept the token, take the tokens the grammar forces next), detokenize, check stops.

``EngineCore`` (core.py) holds a ``StepUpdater`` and calls it at the end of a step (``account``
for the chunks computed, ``take_tokens`` for the tokens read), and when a request's grammar is
attached (``take_first_forced``). Everything it works with is given to it when it is made.
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

    # abort(request, reason, error, error_type): end a request that failed
    Abort = Callable[[Request, str, "str | None", "str | None"], None]


def rejection_message(r: Request, n_output: int) -> str:
    """A dead end in the spec (a grammar that matches nothing from here on): its mask
    allowed only EOS, which it does not accept, or nothing at all."""
    kind = r.spec.kind if r.spec is not None else "grammar"
    return (
        f"the {kind} spec allows no token after {n_output} output tokens "
        f"({r.detok.text[-40:]!r}) and does not accept them: it cannot be completed"
    )


def backend_failure(r: Request, reason: str) -> str:
    return (
        f"{r.matcher.backend_name} failed after {r.num_output} output tokens "
        f"({r.detok.text[-40:]!r}): {reason}; the output is incomplete"
    )


class StepUpdater:
    """Applies a step's results to its requests.

    ``grammar`` returns the engine's GrammarManager (called only for constrained requests,
    which exist only once it does); ``decode`` is the batched detokenizer decode
    (``detokenizer.batch_decoder``). A request that ends goes to ``scheduler.finish`` and
    then to ``finished`` (the engine's queue of finished requests); one that fails goes to
    ``abort`` (the engine's, which records the error). ``fast_forward``: take the tokens a
    grammar forces; ``overlap``: have the mask workers fill the next step's masks early.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        kv: KVCacheManager,
        grammar: Callable[[], GrammarManager],
        decode: Callable[[list[list[int]]], list[str]],
        eos_token_ids: set[int],
        max_model_len: int,
        *,
        fast_forward: bool,
        overlap: bool,
        finished: Callable[[Request], None],
        abort: Abort,
    ) -> None:
        self._scheduler = scheduler
        self._kv = kv
        self._grammar = grammar
        self._decode = decode
        self._eos_token_ids = eos_token_ids
        self._max_model_len = max_model_len
        self._fast_forward = fast_forward
        self._overlap = overlap
        self._finished = finished
        self._abort = abort

    def account(self, batch: Batch) -> None:
        """The step's chunks are computed (or queued on the device, ahead of anything that
        reads them): count them, and publish the pages they completed."""
        ps = self._kv.page_size
        for c in batch.chunks:
            r = c.request
            if r.finished:  # ended by the previous step's tokens (pipelined loop): pages gone
                continue
            r.num_computed += c.num_new
            if r.num_computed // ps > (r.num_computed - c.num_new) // ps:
                # A page completed (by a prefill chunk or a decode step): publish it to the
                # prefix cache now, not at finish, so requests that wait on the same prefix
                # (Scheduler._prefix_in_flight) reuse it next step.
                self._kv.share_progress(r)

    def take_tokens(self, rows: list[tuple[Request, int, dict[int, float] | None]]) -> None:
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
            self._grammar().advance_async(
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
                    rejection_message(r, r.num_output) if r.matcher.dead_end else backend_failure(r, r.matcher.failure)
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
                    rejection_message(r, r.num_output - 1)
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
        if self._overlap and forced_rows:
            # The next step's masks of the requests that go on, computed by the mask workers
            # from now on, while this thread finishes the step and prepares the next one.
            self._grammar().prefill_masks([r.matcher for r, _ in forced_rows if not r.finished])

    def take_first_forced(self, ready: list[Request]) -> None:
        """Requests whose grammar was just attached: append the tokens it forces before the
        first sampled one (they join the prefill), and end the requests it ends."""
        results = self._grammar().advance([(r.matcher, [], self._ff_room(r), r.params.stop_token_ids) for r in ready])
        for r, res in zip(ready, results):
            if res is None:
                self._abort(r, "abort", backend_failure(r, r.matcher.failure), "GrammarError")
                continue
            if not self._check_stop(r, [], res.finished_first):
                [forced] = self._append_forced([(r, res.forced)])
                self._check_stop(r, forced, res.finished)

    def _ff_room(self, r: Request, last: int | None = None) -> int:
        """How many forced tokens r may take now (0: fast-forward off, or ``last``, the token
        just sampled, ends the request anyway)."""
        if not self._fast_forward or (
            last is not None
            and (last in r.params.stop_token_ids or (not r.params.ignore_eos and last in self._eos_token_ids))
        ):
            return 0
        return max(0, min(r.params.max_tokens - r.num_output, self._max_model_len - r.num_tokens))

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

    def _emit_many(self, rows: list[tuple[Request, list[int]]]) -> None:
        """Push each request's new tokens through its detokenizer (one batched decode for all
        of them): stop strings are matched on that text, and Engine.stream reads it."""
        items = []
        for r, toks in rows:
            r.text_state.mark = len(r.text_state.detok.text)
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
        if new and not p.ignore_eos and new[-1] in self._eos_token_ids:
            reason = "stop"
        elif new and new[-1] in p.stop_token_ids:
            reason, r.stop_reason = "stop", new[-1]
            r.text_state.end = r.text_state.mark  # the stop token's text is not part of the output
        elif p.stop and (seen := stop_string_seen(r)) is not None:
            # Before the grammar's end: a stop string in the closing text (a "}") cuts it.
            reason, r.stop_reason = "stop", seen
        elif grammar_finished:
            reason = "stop"
        elif r.num_output >= p.max_tokens or r.num_tokens >= self._max_model_len:
            reason = "length"
        if reason is None:
            return False
        self._scheduler.finish(r, reason)
        self._finished(r)
        return True
