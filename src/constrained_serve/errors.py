"""Typed errors. Every error a user can cause is a ValueError subclass naming the problem."""

from __future__ import annotations


class ConstrainedServeError(Exception):
    """Base class of this library's own errors."""


class GrammarError(ConstrainedServeError, ValueError):
    """A schema, regex or grammar that a backend cannot compile (or would silently approximate).

    Raised at submit, before any model work. ``backend`` names the grammar backend and
    ``reason`` carries the backend's own message.
    """

    def __init__(self, message: str, *, backend: str | None = None, reason: str | None = None):
        super().__init__(message)
        self.backend = backend
        self.reason = reason


class PromptTooLongError(ConstrainedServeError, ValueError):
    """A prompt that can never fit: longer than the model's context or the whole KV pool."""


class OutputError(ConstrainedServeError, ValueError):
    """Raised by ``raise_on_error=True`` when an output is truncated or fails to parse (the
    subclass OutputValidationError when it parsed but did not validate; a spec the backend
    refused or gave up on raises GrammarError instead)."""


class OutputValidationError(OutputError):
    """A complete output that the user's Pydantic type refuses (a validator, a constraint
    JSON Schema cannot express), or that the spec refuses where the grammar backend read it
    more loosely (see grammar.output_check._check_conformance). ``value`` holds the parsed JSON
    (None for a regex output); raised with ``raise_on_error=True``, its ``__cause__`` is
    Pydantic's ValidationError where Pydantic refused it."""

    def __init__(self, message: str, value: object):
        super().__init__(message)
        self.value = value
