"""constrained-serve: structured generation with continuous batching.

from constrained_serve import Engine, SamplingParams
engine = Engine()
[r] = engine.chat([{"role": "user", "content": "..."}], SamplingParams(max_tokens=64), schema=MyModel)
"""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from .errors import GrammarError, OutputError, OutputValidationError, PromptTooLongError
from .params import OutputSpec, SamplingParams
from .result import Result, ToolCall, Usage

__all__ = [
    "AsyncEngine",
    "Engine",
    "GrammarError",
    "Grounded",
    "OutputError",
    "OutputValidationError",
    "PromptTooLongError",
    "OutputSpec",
    "Result",
    "SamplingParams",
    "ToolCall",
    "Usage",
    "generate",
    "default_engine",
    "__version__",
]

if TYPE_CHECKING:
    from .api import Engine
    from .async_engine import AsyncEngine


def __getattr__(name: str) -> Any:
    # Engine (torch, transformers, the model code) is imported on first use, so the grammar
    # worker processes, which import this package, start in a fraction of a second.
    if name == "Engine":
        from .api import Engine

        globals()["Engine"] = Engine
        return Engine
    if name == "AsyncEngine":
        from .async_engine import AsyncEngine

        globals()["AsyncEngine"] = AsyncEngine
        return AsyncEngine
    if name == "Grounded":  # pydantic, imported on first use too
        from .grammar.grounding import grounded_type

        globals()["Grounded"] = grounded_type()
        return globals()["Grounded"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_default_engine: "Engine | None" = None
_default_lock = threading.Lock()


def default_engine() -> Engine:
    """The lazily created default Engine (default model, default settings) of ``generate``."""
    global _default_engine
    with _default_lock:
        if _default_engine is None:
            from .api import Engine

            _default_engine = Engine()
        return _default_engine


_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def generate(prompt_or_messages: Any, **kwargs: Any) -> Any:
    """One-liner for notebooks and scripts: ``generate("...", schema=Invoice, max_tokens=200)``.

    A string or one message list returns one Result; a list of them returns a list. Message
    lists go through the chat template; strings are sent as they are.
    """
    sampling = {k: kwargs.pop(k) for k in list(kwargs) if k in _SAMPLING_FIELDS}
    params = kwargs.pop("params", None)
    if params is not None and sampling:
        raise TypeError(f"pass either params= or sampling keywords ({sorted(sampling)}), not both")
    params = params or SamplingParams(**sampling)
    eng = default_engine()
    x = prompt_or_messages
    is_messages = isinstance(x, list) and x and isinstance(x[0], dict)
    # A list of message lists; a list of token-id lists is a list of raw prompts.
    is_list_of_messages = (
        isinstance(x, list) and x and isinstance(x[0], list) and (not x[0] or isinstance(x[0][0], dict))
    )
    if isinstance(x, str):
        return eng.generate(x, params, **kwargs)[0]
    if is_messages:
        return eng.chat(x, params, **kwargs)[0]
    if is_list_of_messages:
        return eng.chat(x, params, **kwargs)
    return eng.generate(list(x), params, **kwargs)
