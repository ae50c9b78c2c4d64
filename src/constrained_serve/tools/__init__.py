"""Tool calling (``Engine.chat(messages, tools=[...], tool_choice=...)``), constrained by the
decoder: every call returned parses and matches its function's parameters schema, in every
``tool_choice`` mode.

- formats.py: the call format of each chat-template family (one table).
- grammar.py: the Lark grammar (llguidance, ``%json`` per function) of a tool_choice.
- prompt.py: tools and tool messages into the chat template (or our default system prompt).
- parse.py: the finished output -> ``Result.tool_calls``.

``ToolPlan`` ties them for one call: ``ToolPlan.make`` checks the tools and the tool_choice
(ValueError naming the problem), the RequestBuilder (inputs.py) renders each conversation
with ``plan.render`` and decodes under ``plan.spec``, and ``plan.fill`` turns each finished
Result's text into its tool calls.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import GrammarError, OutputError, OutputValidationError
from ..params import OutputSpec
from ..result import Result
from .formats import DEFAULT, FORMATS, CallFormat, format_for_template, template_takes_tools
from .grammar import tool_grammar
from .parse import parse_tool_calls
from .prompt import DEFAULT_SYSTEM_PROMPT, for_template, rewritten

__all__ = ["DEFAULT", "DEFAULT_SYSTEM_PROMPT", "FORMATS", "CallFormat", "ToolPlan", "TOOL_KEYS"]

TOOL_KEYS = ("tools", "tool_choice", "parallel_tool_calls")
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})


def _closed(node: Any) -> Any:
    """Objects that declare properties and say nothing of others get
    ``additionalProperties: false``: the model cannot invent arguments (a copy)."""
    if isinstance(node, dict):
        out = {k: (v if k in _DATA_KEYWORDS else _closed(v)) for k, v in node.items()}
        if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_closed(v) for v in node]
    return node


def _function(i: int, tool: Any) -> dict[str, Any]:
    """tools[i] as OpenAI's {"name", "description"?, "parameters"} (a bare function dict is taken too)."""
    if not isinstance(tool, dict):
        raise ValueError(f"tools[{i}]: expected a dict, got {type(tool).__name__}")
    if "function" in tool or "type" in tool:
        if tool.get("type", "function") != "function":
            raise ValueError(f"tools[{i}]: only tools of type 'function' are supported, got {tool.get('type')!r}")
        fn = tool.get("function")
    else:
        fn = tool
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not _NAME.fullmatch(fn["name"]):
        got = fn.get("name") if isinstance(fn, dict) else fn
        raise ValueError(f"tools[{i}]: function.name must be 1 to 64 of [A-Za-z0-9_.:-], got {got!r}")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise ValueError(
            f"tools[{i}] (function {fn['name']!r}): parameters must be a JSON Schema of an object, got {params!r}"
        )
    try:
        params = json.loads(json.dumps(params))  # a deep copy, and proof it is JSON
    except (TypeError, ValueError) as e:
        raise ValueError(f"tools[{i}] (function {fn['name']!r}): parameters are not JSON: {e}") from e
    return {**fn, "parameters": params}


@dataclass(frozen=True)
class ToolPlan:
    """The tools of one chat call and how they constrain its output."""

    tools: tuple[dict[str, Any], ...]  # as OpenAI writes them: {"type": "function", "function": {...}}
    parameters: dict[str, dict[str, Any]]  # per function name, the schema calls are held to (closed)
    choice: str  # "none" | "auto" | "required" | the one function's name
    parallel: bool
    fmt: CallFormat
    takes_tools: bool  # the chat template renders ``tools`` itself
    spec: OutputSpec | None  # the output's grammar; None for "none"

    @classmethod
    def make(
        cls, tools: Sequence[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None, tokenizer: Any
    ) -> ToolPlan | None:
        """The plan of chat(tools=..., tool_choice=..., parallel_tool_calls=...); None without
        tools. ValueError naming a bad tool or choice."""
        if not tools:
            if tool_choice not in (None, "none"):
                raise ValueError(f"tool_choice={tool_choice!r} needs tools")
            return None
        if isinstance(tools, (str, bytes, dict)) or not isinstance(tools, Sequence):
            raise ValueError(f"tools must be a list of tools, got {type(tools).__name__}")
        functions = [_function(i, t) for i, t in enumerate(tools)]
        names = [f["name"] for f in functions]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ValueError(f"tools: two functions are named {dup!r}")
        choice = "auto" if tool_choice is None else tool_choice
        if isinstance(choice, dict):
            fn = choice.get("function") if isinstance(choice.get("function"), dict) else choice
            if choice.get("type") != "function" or not isinstance(fn.get("name"), str):
                expected = '{"type": "function", "function": {"name": ...}}'
                raise ValueError(f"tool_choice: expected {expected}, got {choice!r}")
            if fn["name"] not in names:
                raise ValueError(f"tool_choice names {fn['name']!r}, which is not among the tools {names}")
            choice = fn["name"]
        elif choice not in ("none", "auto", "required"):
            raise ValueError(
                f"tool_choice must be 'none', 'auto', 'required' or "
                f'{{"type": "function", "function": {{"name": ...}}}}, got {choice!r}'
            )
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise ValueError(f"parallel_tool_calls must be true or false, got {parallel_tool_calls!r}")
        # OpenAI's default, several calls, except for one named function: one call, as a
        # forced function call is (and as instructor and langchain's structured output expect).
        parallel = choice in ("auto", "required") if parallel_tool_calls is None else parallel_tool_calls
        fmt = format_for_template(tokenizer)
        parameters = {f["name"]: _closed(f["parameters"]) for f in functions}
        spec = None
        if choice != "none":
            callable_ = [(n, parameters[n]) for n in names if choice in ("auto", "required") or n == choice]
            mode = "auto" if choice == "auto" else "required"
            spec = OutputSpec("lark", tool_grammar(callable_, fmt, mode, parallel))
        return cls(
            tools=tuple({"type": "function", "function": f} for f in functions),
            parameters=parameters,
            choice=choice,
            parallel=parallel,
            fmt=fmt,
            takes_tools=template_takes_tools(tokenizer),
            spec=spec,
        )

    # ------------------------------------------------------------------ compile
    def compile_error(self, error: GrammarError, compile_schema: Callable[[OutputSpec], Any]) -> GrammarError:
        """A compile failure of ``spec`` told by function: each callable function's
        parameters compiled alone (``compile_schema``) until one fails."""
        from ..grammar.spec import make_output_spec

        for name, schema in self.parameters.items():
            if self.choice not in ("auto", "required", name):
                continue
            try:
                compile_schema(make_output_spec(schema=schema))
            except GrammarError as e:
                return GrammarError(
                    f"tools: the parameters schema of function {name!r} cannot be compiled: {e}",
                    backend=e.backend,
                    reason=e.reason,
                )
        return GrammarError(f"tools: the tool-call grammar cannot be compiled: {error}", backend=error.backend)

    # ------------------------------------------------------------------ prompt
    def render(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """(messages, the template's ``tools`` argument or None) for a conversation."""
        if self.takes_tools:
            return for_template(messages), list(self.tools)
        return rewritten(messages, self.tools if self.choice != "none" else None, self.fmt), None

    # ------------------------------------------------------------------ output
    def fill(self, result: Result, raise_on_error: bool = False) -> Result:
        """``result`` (and its samples) with tool_calls and content read from the text."""
        samples = result.samples or [result]
        for s in samples:
            self._fill_one(s)
        if result.samples:
            first = samples[0]
            result.tool_calls, result.content = first.tool_calls, first.content
            if first.error is not None and result.error is None:
                result.error, result.error_type, result.json = first.error, first.error_type, first.json
        if raise_on_error and result.error is not None:
            if result.error_type == "OutputValidationError":
                raise OutputValidationError(f"request {result.index}: {result.error}", result.json)
            raise OutputError(f"request {result.index}: {result.error}")
        return result

    def _fill_one(self, r: Result) -> None:
        if self.spec is None or r.finish_reason != "stop" or r.error is not None:
            r.content = r.text or None
            return
        try:
            r.content, calls = parse_tool_calls(r.text, self.fmt, self.parameters)
        except OutputValidationError as e:
            r.error, r.error_type, r.json = str(e), type(e).__name__, e.value
            return
        except ValueError as e:
            r.error, r.error_type = f"the tool calls do not parse: {e}", "OutputError"
            return
        r.tool_calls = calls or None
        if calls:
            r.parsed = r.json = None  # the output is calls, not one value
