"""A request's state, tracked by counters rather than phases.

``token_ids`` is prompt + everything generated or forced so far; ``num_computed`` tokens have
their KV in the cache (``num_cached`` of those came from the prefix cache). The tokens still to
feed are ``token_ids[num_computed:]``: the rest of a prompt (chunked prefill), the one token
sampled last step (decode), or that token plus forced tokens (fast-forward). Preemption just
resets ``num_computed``; multi-turn append is a prompt that starts with cached history.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..params import OutputSpec, SamplingParams
from .detokenizer import IncrementalDetokenizer, cut_at_stop

if TYPE_CHECKING:
    from concurrent.futures import Future

    from ..cache.radix import Node
    from ..grammar.base import CompiledGrammar
    from ..grammar.matchers import MatcherHandle

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"  # not admitted (or preempted): holds no pages
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class GrammarState:
    """A constrained request's grammar: compiling in the background (``future``) until the
    engine attaches it before a schedule (``compiled`` and a ``matcher`` of it)."""

    future: "Future[CompiledGrammar] | None" = None
    compiled: "CompiledGrammar | None" = None
    matcher: "MatcherHandle | None" = None


@dataclass(eq=False)
class OutputText:
    """The output's text, as the step's update builds it (step_update.py) and stop strings
    are searched in it (stop_strings.py)."""

    detok: IncrementalDetokenizer
    stop_scanned: int = 0  # characters of detok.text already searched for stop strings
    mark: int = 0  # len(detok.text) before the latest tokens were pushed
    end: int | None = None  # set by a stop token: its text is left out, as in vLLM


@dataclass(eq=False)
class Request:
    # What was asked (the API's)
    prompt_ids: list[int]
    params: SamplingParams
    spec: OutputSpec | None = None
    seed: int = 0
    index: int = 0  # position in the caller's input list
    request_id: int = field(default_factory=lambda: next(_ids))

    # Progress (the scheduler's and the step's)
    token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached: int = 0  # prompt tokens served by the prefix cache at (first) admission
    status: Status = Status.WAITING
    num_preemptions: int = 0
    # Pipelined loop (core.py): the row of the launched step whose sampled token is not read
    # yet; token_ids ends with a placeholder for it until then.
    pending_row: int | None = None

    # KV pages (the cache manager's, cache/manager.py)
    pages: list[int] = field(default_factory=list)
    # Bumped by the cache manager on any change to ``pages`` other than an append: it lets the
    # runner's block tables (runtime/block_tables.py) rewrite only what changed since a step.
    pages_version: int = 0
    cache_node: "Node | None" = None  # locked radix node covering pages[:num_shared // page_size]
    num_shared: int = 0  # leading tokens whose pages are shared with the prefix cache

    # Grammar
    grammar: GrammarState | None = None  # None: unconstrained
    num_forced: int = 0  # output tokens the grammar forced (not sampled)

    # Output
    text_state: OutputText | None = None  # made when the engine takes the request
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    error: str | None = None
    error_type: str | None = None
    # Per output token when params.logprobs is set: {token: logprob, ...}; None for forced tokens.
    logprobs: list[dict[int, float] | None] | None = None
    # Per prompt token when its prompt logprobs are wanted (set by the API: [None], the first
    # token's); entry i is filled from the logits at position i - 1. Such a request computes
    # its prompt itself: the prefix cache does not keep logits.
    prompt_logprobs: list[dict[int, float] | None] | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)
        if (self.params.logprobs is not None or self.params.field_confidence) and self.logprobs is None:
            self.logprobs = []

    @property
    def detok(self) -> IncrementalDetokenizer | None:
        """The output's detokenizer (its ``text`` is the output text so far)."""
        return self.text_state.detok if self.text_state is not None else None

    @property
    def matcher(self) -> "MatcherHandle | None":
        return self.grammar.matcher if self.grammar is not None else None

    @property
    def compiling(self) -> bool:
        """Its grammar is compiling, or compiled but not attached yet."""
        return self.grammar is not None and self.grammar.future is not None

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_pending(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def visible_text(self, final: bool) -> str:
        """The output text a user sees: without the text of a stop token, cut before the
        first stop string (and, while it can still grow, before a tail that may start one)."""
        t = self.text_state
        text = t.detok.text if t.end is None else t.detok.text[: t.end]
        return cut_at_stop(text, self.params.stop, final=final)
