"""vLLM's request fields beyond the output spec itself, read into Engine keywords.

- ``guided_grammar`` / ``structured_outputs.grammar`` in GBNF (vLLM's xgrammar syntax,
  ``root ::= ...``): detected by a ``name ::=`` rule, else read as Lark.
- ``guided_whitespace_pattern``: the whitespace allowed between JSON tokens. ``""`` is this
  server's default (compact JSON); a pattern that takes spaces, newlines and tabs (``[ \\n\\t]*``,
  ``\\s*``) allows free whitespace (``json_whitespace``); any other is refused, as no backend
  here takes an arbitrary pattern.
- ``chat_template_kwargs`` (chat only): extra variables for the chat template, such as
  ``{"enable_thinking": false}``.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["is_gbnf", "vllm_spec_fields"]

_GBNF_RULE = re.compile(r"^\s*[A-Za-z_][\w-]*\s*::=", re.MULTILINE)
_RESERVED_TEMPLATE_KEYS = frozenset({"messages", "conversation", "add_generation_prompt", "tokenize", "tools"})


def is_gbnf(grammar: str) -> bool:
    """A grammar written as GBNF/EBNF (``root ::= ...``) rather than Lark (``start: ...``)."""
    return bool(_GBNF_RULE.search(grammar))


def _free_whitespace(pattern: str) -> bool:
    try:
        rx = re.compile(pattern)
    except re.error as e:
        raise ValueError(f"guided_whitespace_pattern: not a regular expression: {e}") from None
    takes = all(rx.fullmatch(w) for w in ("", " ", "\n", "\t", "  \n  "))
    refuses = not any(rx.fullmatch(x) for x in ("a", "0", '"', ",", ":"))
    return takes and refuses


def vllm_spec_fields(req: Any, specs: dict[str, Any]) -> None:
    """Add to ``specs`` (Engine keywords) what ``req``'s vLLM fields ask; ValueError naming a bad one."""
    if isinstance(specs.get("grammar"), str) and is_gbnf(specs["grammar"]):
        specs["grammar_syntax"] = "gbnf"
    pattern = getattr(req, "guided_whitespace_pattern", None)
    if pattern:
        if not _free_whitespace(pattern):
            raise ValueError(
                f'guided_whitespace_pattern {pattern[:100]!r} is not supported: give "" (compact JSON, the '
                'default) or a pattern of free whitespace such as "[ \\n\\t]*"'
            )
        if any(k in specs for k in ("schema", "response_format")):
            specs["json_whitespace"] = True
    ctk = getattr(req, "chat_template_kwargs", None)
    if ctk:
        reserved = sorted(set(ctk) & _RESERVED_TEMPLATE_KEYS)
        if reserved:
            raise ValueError(f"chat_template_kwargs: {reserved} are set by the server, not the request")
        specs["chat_template_kwargs"] = dict(ctk)
