"""One generate / chat / stream call as asked (``Call``), and one item of it on its way
through the engine (``Entry``). ``Engine`` (api.py) and ``AsyncEngine`` build a Call from
their arguments; the RequestBuilder (inputs.py) turns it into entries; ``Engine.result_of``
turns a done entry into its Result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .engine.request import Request
from .params import SamplingParams
from .result import Result

if TYPE_CHECKING:
    from .tools import ToolPlan

__all__ = ["Call", "Entry", "Messages", "ParamsArg", "keyword_params", "split_chat_messages"]

Messages = list[dict[str, Any]]
ParamsArg = SamplingParams | Sequence[SamplingParams] | None  # one for all items, or one each


def split_chat_messages(messages: Any) -> tuple[list[Messages], bool]:
    """``chat()``'s input as a list of conversations, and whether it was one conversation
    (a list of messages) rather than a list of them."""
    if isinstance(messages, (str, bytes, dict)):
        raise TypeError(
            f"chat() takes a list of {{'role': ..., 'content': ...}} messages (or a list of such "
            f"lists), got a {type(messages).__name__}; for raw text use generate()"
        )
    single = len(messages) > 0 and isinstance(messages[0], dict)
    items = [messages] if single else list(messages)
    bad = next((m for m in items if isinstance(m, (str, bytes))), None)
    if bad is not None:
        raise TypeError(
            "chat() takes a list of {'role': ..., 'content': ...} messages (or a list of such lists), "
            f"got a list of strings ({bad!r:.40}); for one user message each pass "
            "[[{'role': 'user', 'content': s}] for s in texts], or use generate() for raw text"
        )
    return items, single


_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def keyword_params(params: Any, spec_kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """SamplingParams' fields given as keywords (``generate(..., max_tokens=40)``) taken out of
    ``spec_kwargs`` into a SamplingParams; TypeError when ``params`` is given too."""
    sampling = {k: spec_kwargs[k] for k in spec_kwargs if k in _SAMPLING_FIELDS}
    if not sampling:
        return params, spec_kwargs
    if params is not None:
        raise TypeError(
            f"pass either params= or SamplingParams fields as keywords ({', '.join(sorted(sampling))}), not both"
        )
    rest = {k: v for k, v in spec_kwargs.items() if k not in _SAMPLING_FIELDS}
    return SamplingParams(**sampling), rest


@dataclass(frozen=True)
class Call:
    """One generate / chat / generate_iter call as asked (``Engine`` and ``AsyncEngine``):
    its items, one Result each, and how a problem of one item comes back."""

    items: Iterable[Any]  # prompts (text or token ids) or conversations; a list, or any iterable
    params: ParamsArg
    chat: bool
    spec_kwargs: dict[str, Any]
    raise_on_error: bool = False
    single: bool = False  # one prompt or conversation given bare: its problem raises
    progress: bool = False

    def __post_init__(self) -> None:
        params, spec_kwargs = keyword_params(self.params, self.spec_kwargs)
        object.__setattr__(self, "params", params)
        object.__setattr__(self, "spec_kwargs", spec_kwargs)

    @classmethod
    def of(
        cls,
        given: Any,
        params: ParamsArg,
        chat: bool,
        spec_kwargs: dict[str, Any],
        *,
        raise_on_error: bool = False,
        progress: bool = False,
    ) -> Call:
        """generate()'s prompt or prompts, or chat()'s conversation or conversations."""
        if chat:
            items, single = split_chat_messages(given)
        else:
            single = isinstance(given, str)
            items = [given] if single else list(given)
        return cls(items, params, chat, spec_kwargs, raise_on_error, single, progress)

    @classmethod
    def stream(cls, prompt: Any, params: SamplingParams | None, spec_kwargs: dict[str, Any]) -> Call:
        """A stream's call (``Engine.stream``, ``AsyncEngine.open_stream``): one prompt (text)
        or conversation (a message list), one SamplingParams with n=1; its problems raise."""
        params, spec_kwargs = keyword_params(params, spec_kwargs)
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"stream takes one prompt and one SamplingParams, got {type(params).__name__}")
        params.validate()
        if params.n != 1:
            raise ValueError(f"stream yields one completion: n must be 1, got {params.n}")
        return cls([prompt], params, not isinstance(prompt, str), spec_kwargs, raise_on_error=True, single=True)


@dataclass(eq=False)
class Entry:
    """One item of a call: its requests (one, or n for SamplingParams(n)), not yet added to
    the core, or the error Result of an item that never became a request (too long, a bad
    per-item spec). ``Engine.result_of`` turns a done entry into its Result."""

    index: int
    item: Any  # the prompt or conversation as given
    requests: list[Request] = field(default_factory=list)
    error: Result | None = None
    tools: ToolPlan | None = None  # a chat with tools: its Result's tool_calls come from it

    @property
    def done(self) -> bool:
        """Its Result can be handed back: an error, or all its requests finished."""
        return self.error is not None or all(r.finished for r in self.requests)

    @property
    def weight(self) -> int:
        """What it counts against generate_iter's max_in_flight: its number of requests (1 for an error)."""
        return max(1, len(self.requests))
