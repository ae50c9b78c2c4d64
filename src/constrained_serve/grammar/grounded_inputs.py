"""A call's grounding arguments (``grounded=``, ``source_text=``; grounding.py says what a
grounded field is) and the source text of each of its items, which its spec's ``Grounding``
carries: the user messages of a chat, the prompt of a generate, unless source_text is given.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from ..errors import GrammarError
from ..params import Grounding, OutputSpec
from .grounding import has_grounded_marks

__all__ = ["GroundingArgs", "grounding_args", "marks_grounded", "with_grounding"]


@dataclass(frozen=True)
class GroundingArgs:
    """``grounded=`` and ``source_text=`` of a call (see ``grounding_args``)."""

    unit: str  # "words" | "chars"
    all_strings: bool  # grounded=True/"words"/"chars": every plain string field
    source_text: Any = None  # None, a text for all items, or a list with one per item

    def source_of(self, i: int, item: Any, chat: bool) -> tuple[str, ...]:
        """Item i's source texts: source_text, else a chat's user messages, else the prompt."""
        given = self.source_text[i] if isinstance(self.source_text, list) else self.source_text
        if given is not None:
            if not isinstance(given, str):
                raise ValueError(f"source_text must be a string (or a list of them), got {type(given).__name__}")
            return (given,)
        if not chat:
            if not isinstance(item, str):
                raise ValueError("grounded fields of a prompt given as token ids need source_text=")
            return (item,)
        sources = tuple(_message_text(m) for m in item if isinstance(m, dict) and m.get("role") == "user")
        if not sources:
            raise ValueError(
                "grounded fields quote the user messages, and this conversation has none (or pass source_text=)"
            )
        return sources


def _message_text(message: dict[str, Any]) -> str:
    """A message's text: its content string, or its text parts joined (OpenAI's content parts)."""
    content = message.get("content")
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content if isinstance(content, str) else ""


def grounding_args(args: dict[str, Any], items: Any, chat: bool) -> GroundingArgs | None:
    """The call's ``grounded=`` (False: only fields marked ``"x-grounded"``; True or
    "words": every plain string field, spans at word boundaries; "chars": the same, at
    any character) and ``source_text=`` (a text, or one per item; default: a chat's user
    messages, a prompt's text)."""
    grounded, source = args.pop("grounded", None), args.pop("source_text", None)
    if grounded in (None, False) and source is None:
        return None
    if grounded not in (None, False, True, "words", "chars"):
        raise ValueError(f"grounded must be True, False, 'words' or 'chars', got {grounded!r}")
    if isinstance(source, list) and (not isinstance(items, list) or len(source) != len(items)):
        raise ValueError("source_text: a list gives one text per prompt, and needs a list of as many prompts")
    if source is not None and not isinstance(source, (str, list)):
        raise ValueError(f"source_text must be a string or a list of strings, got {type(source).__name__}")
    unit = "chars" if grounded == "chars" else "words"
    return GroundingArgs(unit, grounded not in (None, False), source)


def marks_grounded(spec: OutputSpec) -> bool:
    """A JSON Schema spec with a field marked ``"x-grounded"`` (a quick look at its text first)."""
    if spec.kind != "json_schema" or '"x-grounded"' not in spec.text:
        return False
    return has_grounded_marks(json.loads(spec.text))


def with_grounding(spec: OutputSpec | None, args: GroundingArgs | None, sources: tuple[str, ...]) -> OutputSpec | None:
    """``spec`` with a Grounding of ``sources`` where the call or its schema asks for one."""
    every = args is not None and args.all_strings
    if spec is None or not (every or marks_grounded(spec)):
        if every:
            raise GrammarError("grounded=True needs a JSON Schema output (schema= or a json_schema response_format)")
        return spec
    if spec.kind != "json_schema":
        raise GrammarError(f"grounded fields need a JSON Schema output, not a {spec.kind} spec")
    args = args or GroundingArgs("words", False)
    return dataclasses.replace(spec, grounding=Grounding(sources, args.unit, args.all_strings))  # type: ignore[arg-type]
