"""Function tools on OpenAI's Responses API (``/v1/responses``), mapped onto Engine.chat's tool
calling (tools/), so every call returned parses and matches its function's parameters.

The Responses API spells things its own way; this module translates, nothing more:

- ``tools``: ``{"type": "function", "name", "description", "parameters", "strict"}`` (flat,
  not under ``"function"`` as in chat completions). Other tool types (``web_search``,
  ``file_search``, ...) are refused with a 400 naming them: this server runs none.
- ``tool_choice``: ``"none"``, ``"auto"``, ``"required"`` or ``{"type": "function", "name"}``.
- ``input`` items ``{"type": "function_call", "call_id", "name", "arguments"}`` (an earlier
  call) and ``{"type": "function_call_output", "call_id", "output"}`` (its result) become the
  assistant ``tool_calls`` message and the ``tool`` message of a chat.
- Each call of a Result is an output item ``{"type": "function_call", "id": "fc_...",
  "call_id", "name", "arguments", "status": "completed"}``, after the message item when the
  model wrote text before its calls.
"""

from __future__ import annotations

import json
from typing import Any

from ..result import ToolCall

__all__ = ["chat_tool_kwargs", "call_item", "history_item", "is_tool_item"]


def _tool(i: int, tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise ValueError(f"tools[{i}]: expected an object, got {type(tool).__name__}")
    kind = tool.get("type")
    if kind != "function":
        raise ValueError(f"tools[{i}]: tools of type {kind!r} are not supported by this server (function tools only)")
    if "function" in tool:  # the chat completions shape sent here by mistake: take it too
        return {"type": "function", "function": tool["function"]}
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice  # none / auto / required; anything else is refused by ToolPlan with its reason
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name", (choice.get("function") or {}).get("name"))
        return {"type": "function", "function": {"name": name}}
    raise ValueError(
        f"tool_choice: expected 'none', 'auto', 'required' or {{'type': 'function', 'name': ...}}, got {choice!r}"
    )


def chat_tool_kwargs(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None) -> dict[str, Any]:
    """Engine.chat's tool keywords of a Responses request ({} when no tool may be called)."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ValueError(f"tool_choice {tool_choice!r} needs tools")
        return {}
    kw: dict[str, Any] = {"tools": [_tool(i, t) for i, t in enumerate(tools)]}
    if tool_choice is not None:
        kw["tool_choice"] = _tool_choice(tool_choice)
    if parallel_tool_calls is not None:
        kw["parallel_tool_calls"] = parallel_tool_calls
    return kw


def is_tool_item(item: dict[str, Any]) -> bool:
    return item.get("type") in ("function_call", "function_call_output")


def history_item(i: int, item: dict[str, Any], out: list[dict[str, Any]]) -> None:
    """Append an input ``function_call`` / ``function_call_output`` item to the chat messages
    ``out``: consecutive calls share one assistant message, as one turn's parallel calls do."""
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise ValueError(f"input[{i}]: a {item['type']} item needs a 'call_id' string")
    if item["type"] == "function_call_output":
        output = item.get("output")
        if not isinstance(output, str):
            output = json.dumps(output, ensure_ascii=False)
        out.append({"role": "tool", "tool_call_id": call_id, "content": output})
        return
    name, arguments = item.get("name"), item.get("arguments", "{}")
    if not isinstance(name, str) or not isinstance(arguments, str):
        raise ValueError(f"input[{i}]: a function_call item needs 'name' and 'arguments' strings")
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    last = out[-1] if out else None
    if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last.get("content"):
        last["tool_calls"].append(call)
    else:
        out.append({"role": "assistant", "content": None, "tool_calls": [call]})


def call_item(call: ToolCall, status: str = "completed", arguments: str | None = None) -> dict[str, Any]:
    """A Result's call as a ``function_call`` output item (``arguments`` "" while streaming)."""
    return {
        "id": "fc_" + call.id.removeprefix("call_"),
        "type": "function_call",
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments_json if arguments is None else arguments,
        "status": status,
    }
