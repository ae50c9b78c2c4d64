"""Tools and tool messages into the chat template's input.

A template that takes ``tools`` (Hermes, Llama 3.x, Qwen 2.5/3, SmolLM3 style) gets them as
the ``tools`` argument, and the conversation in Hugging Face's shape (an assistant's
``tool_calls`` with the arguments as a dict, ``role: "tool"`` messages as they are).

A template that does not gets ``DEFAULT_SYSTEM_PROMPT`` (the tools as JSON and the call format)
appended to the system message, or as a system message of its own. The messages it cannot
read are rewritten into ones it can: an assistant message's ``tool_calls`` become the calls
as the model writes them (after its content), and each run of ``role: "tool"`` messages
becomes one user message of ``<tool_response>`` blocks.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from .formats import CallFormat

__all__ = ["DEFAULT_SYSTEM_PROMPT", "default_system_prompt", "for_template", "rewritten"]

DEFAULT_SYSTEM_PROMPT = """\
# Tools

You may call one or more functions to assist with the user query.

The functions you can call, as JSON signatures within <tools></tools> tags:
<tools>
{tools}
</tools>

To call a function, write its name and arguments as a JSON object within <tool_call></tool_call> tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def default_system_prompt(tools: Sequence[dict[str, Any]], fmt: CallFormat) -> str:
    """``DEFAULT_SYSTEM_PROMPT`` for ``tools`` (OpenAI's {"type": "function", "function": ...}
    dicts), its call example spelled in ``fmt``."""
    text = DEFAULT_SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    example = f'{{"name": <function-name>, "{fmt.args_key}": <args-json-object>}}'
    return text.replace(
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>',
        f"{fmt.start}{example}{fmt.end}",
    )


def _arguments(call: dict[str, Any]) -> tuple[str, Any]:
    """(name, arguments as a value) of an OpenAI tool_calls entry (arguments a JSON string)."""
    fn = call.get("function", call)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"a tool_calls entry needs function.name, got {call!r}")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"tool call {fn['name']!r}: arguments are not JSON: {e}") from e
    return fn["name"], args


def for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that takes tools: tool_calls in Hugging Face's shape."""
    out = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                name, args = _arguments(c)
                entry = {"type": "function", "function": {"name": name, "arguments": args}}
                if c.get("id"):
                    entry["id"] = c["id"]
                calls.append(entry)
            m = {**m, "content": m.get("content") or "", "tool_calls": calls}
        elif m.get("role") == "tool" and m.get("content") is None:
            m = {**m, "content": ""}
        out.append(m)
    return out


def rewritten(
    messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]] | None, fmt: CallFormat
) -> list[dict[str, Any]]:
    """Messages for a template without tools: the default system prompt (when ``tools``),
    tool calls written out, tool results as user messages."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            written = fmt.separator.join(fmt.write(*_arguments(c)) for c in m["tool_calls"])
            text = m.get("content") or ""
            out.append({"role": "assistant", "content": f"{text}{written}" if not text else f"{text}\n{written}"})
        elif role == "tool":
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append(dict(m))
    for m in out:
        m.pop("_tool_results", None)
    if tools:
        prompt = default_system_prompt(tools, fmt)
        if out and out[0].get("role") == "system":
            out[0]["content"] = f"{out[0].get('content') or ''}\n\n{prompt}".lstrip()
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
