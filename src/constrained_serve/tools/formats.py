"""How a model writes a tool call: one small table of call formats, one row per template
family, picked from the chat template's text.

A call is written as ``start + {"name": "<function>", "<args_key>": <arguments>} + end``;
parallel calls are joined by ``separator``. The grammar (grammar.py) writes exactly this
and the parser (parse.py) reads exactly this, so a family is one row here. To add a family,
add a ``CallFormat`` to ``FORMATS`` with the substrings of its chat template that identify
it (``detect``): the first row whose substring the template contains wins, and a template
that matches none (or takes no ``tools``) gets ``DEFAULT`` (Hermes-style).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["CallFormat", "DEFAULT", "FORMATS", "format_for_template", "template_takes_tools"]


@dataclass(frozen=True)
class CallFormat:
    name: str
    detect: tuple[str, ...]  # substrings of a chat template that mark the family
    start: str  # written before each call's JSON object
    end: str  # written after it
    separator: str  # between two calls (parallel_tool_calls)
    args_key: str = "arguments"  # the key of the arguments object: "arguments" or "parameters"

    def head(self, name: str) -> str:
        """The text of a call up to its arguments object: the start and the name."""
        return f'{self.start}{{"name": {json.dumps(name)}, {json.dumps(self.args_key)}: '

    @property
    def trigger(self) -> str:
        """What starts a call, whatever the function: free text (tool_choice "auto") never
        contains it, and the first time it is written the output turns into calls."""
        return f'{self.start}{{"name": "'

    @property
    def marker(self) -> str:
        """What commits the output to a call: free text never contains it (the start marker,
        ``<tool_call>``; the trigger for a format without one). A model that begins a call
        ends up with a call that parses, not with a broken one returned as text."""
        return self.start.strip() or self.trigger

    def write(self, name: str, arguments: Any) -> str:
        """A call as the model writes it (to render an assistant message's tool_calls back)."""
        return f"{self.head(name)}{json.dumps(arguments, ensure_ascii=False)}}}{self.end}"


# Hermes (NousResearch Hermes 2/3, Qwen 2.5/3, SmolLM3, and our default for templates
# without tools): <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>
HERMES = CallFormat("hermes", ("<tool_call>",), start="<tool_call>\n", end="\n</tool_call>", separator="\n")
# Llama 3.1/3.2/3.3 JSON tool calling: {"name": ..., "parameters": {...}}, several joined by "; "
LLAMA3_JSON = CallFormat(
    "llama3_json",
    ('"parameters": dictionary of argument name', "<|python_tag|>"),
    start="",
    end="",
    separator="; ",
    args_key="parameters",
)

FORMATS: tuple[CallFormat, ...] = (HERMES, LLAMA3_JSON)
DEFAULT = HERMES


def _template_text(tokenizer: Any) -> str:
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):  # named templates: the default one, else all of them
        return t.get("default") or "\n".join(str(v) for v in t.values())
    return t or ""


def template_takes_tools(tokenizer: Any) -> bool:
    """Does the tokenizer's chat template render a ``tools`` argument?"""
    return "tools" in _template_text(tokenizer)


def format_for_template(tokenizer: Any) -> CallFormat:
    """The call format of the tokenizer's chat template's family (``DEFAULT`` when none
    matches, or when the template takes no tools: then our default system prompt teaches
    the model ``DEFAULT``'s format)."""
    if not template_takes_tools(tokenizer):
        return DEFAULT
    text = _template_text(tokenizer)
    for fmt in FORMATS:
        if any(s in text for s in fmt.detect):
            return fmt
    return DEFAULT
