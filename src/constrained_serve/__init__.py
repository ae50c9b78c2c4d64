"""constrained-serve: structured generation with continuous batching."""
from __future__ import annotations

__version__ = "0.1.0"

from .errors import GrammarError, OutputError, PromptTooLongError
from .params import OutputSpec, SamplingParams

__all__ = ["GrammarError", "OutputError", "PromptTooLongError", "OutputSpec", "SamplingParams", "__version__"]
