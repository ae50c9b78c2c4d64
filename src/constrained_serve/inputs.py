"""A call's inputs: prompts or message lists, sampling parameters and output specs, turned
into ``Request`` objects. ``RequestBuilder`` is the input side of ``Engine`` (api.py): it turns
a ``Call`` into one ``Entry`` per item; a bad shared spec fails there, before any model work,
and a problem of one item fails that item alone (its entry holds an error Result).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .call import Call, Entry, Messages, ParamsArg
from .engine.request import GrammarState, Request
from .errors import GrammarError, PromptTooLongError
from .grammar.grounded_inputs import GroundingArgs, grounding_args, marks_grounded, with_grounding
from .output import results as outputs
from .params import OutputSpec, SamplingParams
from .runtime.sampler import step_seed

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from .grammar.manager import GrammarManager
    from .tools import ToolPlan


def _per_prompt(key: str, value: Any) -> bool:
    """A list is one spec per prompt, except choices=["yes", "no"] (one spec for all)."""
    return isinstance(value, list) and (
        key != "choices" or (len(value) > 0 and all(isinstance(x, (list, tuple)) or x is None for x in value))
    )


_SPEC_KEYS = ("schema", "regex", "grammar", "choices", "response_format")
_TOOL_KEYS = ("tools", "tool_choice", "parallel_tool_calls")  # chat's tool calling (tools/)
_GROUNDING_KEYS = ("grounded", "source_text")  # grounded fields (grammar/grounded_inputs.py)


def _compile_timeout(params: ParamsArg) -> float | None:
    """The longest compile deadline the call's params ask for (None: one of them takes the default)."""
    timeouts = [p.compile_timeout_s for p in ([params] if not isinstance(params, (list, tuple)) else params) if p]
    return max(timeouts) if all(timeouts) and timeouts else None


@dataclass(frozen=True)
class _CallPlan:
    """What the items of one generate/chat call share (see RequestBuilder._plan)."""

    params_at: Callable[[int], SamplingParams]
    backend: str | None
    per_item_specs: list[dict[str, Any]]
    per_prompt: bool
    shared_spec: OutputSpec | None
    chat: bool
    tools: ToolPlan | None = None
    template_kwargs: dict[str, Any] | None = None  # chat_template_kwargs: extra chat template variables
    grounding: GroundingArgs | None = None  # the items' specs get a Grounding of their source text


class RequestBuilder:
    """The input side of ``Engine``: prompts, message lists, sampling parameters and output
    specs -> ``Request`` objects (seeded from its own random source, compiled through the
    engine's GrammarManager, made on first use by ``grammar``)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        max_model_len: int,
        grammar: Callable[[], GrammarManager],
        seed: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self._grammar = grammar
        self._rng = random.Random(seed)
        self._longest_piece: int | None = None  # bytes of the vocabulary's longest token

    @property
    def grammar(self) -> GrammarManager:
        return self._grammar()

    def encode_prompt(self, prompt: str) -> list[int]:
        self._check_text_length(prompt)
        return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def _check_text_length(self, text: Any) -> None:
        """Refuse, before tokenizing it, a text so long it has more tokens than the context
        holds however it is tokenized (no token spells more than the vocabulary's longest
        piece): tokenizing 20 MB takes 20 s and gigabytes for a prompt that can never run."""
        if not isinstance(text, str) or len(text) < self.max_model_len:
            return
        if self._longest_piece is None:
            vocab = self.tokenizer.get_vocab()
            self._longest_piece = max((len(t.encode("utf-8", "replace")) for t in vocab), default=1) or 1
        if len(text) // self._longest_piece >= self.max_model_len:  # characters: at least one byte each
            raise PromptTooLongError(
                f"prompt has at least {len(text) // self._longest_piece} tokens ({len(text)} characters); "
                f"the model's context (or the KV pool) holds {self.max_model_len}"
            )

    def render_chat(
        self,
        messages: Messages,
        add_generation_prompt: bool = True,
        tools: ToolPlan | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """``messages`` through the chat template; with ``tools``, the tools and any tool
        messages too (through the template when it takes tools, else our default prompt);
        ``template_kwargs``: extra template variables (vLLM's chat_template_kwargs)."""
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
        ):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
        kw: dict[str, Any] = dict(template_kwargs or {})
        if tools is not None:
            messages, template_tools = tools.render(messages)
            if template_tools is not None:
                kw["tools"] = template_tools
        try:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kw
            )
        except Exception as e:  # jinja2 errors, a template's raise_exception(): this item's problem
            raise ValueError(f"the chat template cannot render these messages: {type(e).__name__}: {e}") from e

    def encode_chat(
        self, messages: Messages, tools: ToolPlan | None = None, template_kwargs: dict[str, Any] | None = None
    ) -> list[int]:
        text = self.render_chat(messages, tools=tools, template_kwargs=template_kwargs)
        self._check_text_length(text)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def make_spec(self, **spec_kwargs: Any) -> OutputSpec | None:
        if all(spec_kwargs.get(k) is None for k in _SPEC_KEYS):
            return None
        from .grammar.spec import make_output_spec

        return make_output_spec(**spec_kwargs)

    def _split_specs(self, n: int, spec_args: dict[str, Any]) -> tuple[list[dict[str, Any]], bool]:
        """One spec for all prompts, or one per prompt (a list of length n for a spec argument)."""
        per_prompt = {}
        for k in _SPEC_KEYS:
            v = spec_args.get(k)
            is_list = _per_prompt(k, v)
            if is_list and len(v) != n:
                raise GrammarError(f"{k}: a list gives one spec per prompt; got {len(v)} for {n} prompts")
            if is_list:
                per_prompt[k] = v
        if not per_prompt:
            return [spec_args] * n, False
        out = []
        for i in range(n):
            d = dict(spec_args)
            for k, v in per_prompt.items():
                d[k] = v[i]
            out.append(d)
        return out, True

    def new_request(
        self,
        ids: list[int],
        params: SamplingParams,
        spec: OutputSpec | None,
        index: int,
        backend: str | None,
        sample: int = 0,
    ) -> Request:
        if len(ids) == 0:
            raise ValueError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens; the model's context (or the KV pool) holds {self.max_model_len}"
            )
        seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        if sample:  # sample 0 keeps the seed: with n=1 the same seed gives the same output
            seed = step_seed(seed, -sample)
        r = Request(prompt_ids=ids, params=params, spec=spec, seed=seed, index=index)
        if params.prompt_logprobs is not None and sample == 0:  # the samples share one prompt
            r.prompt_logprobs = [None]
        if spec is not None:
            r.grammar = GrammarState(future=self.grammar.compile_async(spec, backend, params.compile_timeout_s))
        return r

    @staticmethod
    def _spec_args(spec_kwargs: dict[str, Any]) -> tuple[str | None, dict[str, Any], dict[str, Any]]:
        """(grammar_backend, the output-spec arguments, the tool arguments); unknown keywords
        raise TypeError."""
        spec_kwargs = dict(spec_kwargs)
        spec_kwargs.pop("chat_template_kwargs", None)  # not a spec: see _plan
        backend = spec_kwargs.pop("grammar_backend", None)
        tool_args = {k: spec_kwargs.pop(k) for k in _TOOL_KEYS if k in spec_kwargs}
        # (grounded=/source_text= travel with the tool arguments: both shape the spec per item)
        tool_args.update({k: spec_kwargs.pop(k) for k in _GROUNDING_KEYS if k in spec_kwargs})
        if backend is not None and backend not in ("llguidance", "xgrammar"):
            raise ValueError(f"grammar_backend must be 'llguidance' or 'xgrammar', got {backend!r}")
        spec_args = {
            k: spec_kwargs.pop(k)
            for k in list(spec_kwargs)
            if k in _SPEC_KEYS
            or k in ("grammar_syntax", "json_whitespace", "json_open_objects", "strict", "unicode_classes")
        }
        if spec_kwargs:
            raise TypeError(f"unexpected keyword arguments: {sorted(spec_kwargs)}")
        return backend, spec_args, tool_args

    def entries(self, call: Call) -> Iterator[Entry]:
        """One Entry per item of ``call``, built as they are read (generate_iter's items may
        be an endless iterator). What the items share is checked first, here at the call: a
        bad shared spec, bad params or keywords raise before any model work."""
        plan = self._plan(call)
        return (self._entry(call, plan, i, item) for i, item in enumerate(call.items))

    def _plan(self, call: Call) -> _CallPlan:
        """What every item of one call shares: its params, its spec(s), the grammar backend.
        A bad shared spec raises here, before any model work."""
        items, params, chat, spec_kwargs = call.items, call.params, call.chat, call.spec_kwargs
        params_at = self._params_per_item(items, params)
        backend, spec_args, tool_args = self._spec_args(spec_kwargs)
        grounding = grounding_args(tool_args, items, chat)
        tools = self._tool_plan(chat, tool_args, spec_args, backend)
        if tools is not None and tools.spec is not None and grounding is not None:
            raise GrammarError("grounded= and source_text= apply to a JSON Schema output, not to tool calls")
        template_kwargs = spec_kwargs.get("chat_template_kwargs")
        if template_kwargs is not None and not isinstance(template_kwargs, dict):
            raise TypeError(f"chat_template_kwargs must be a dict, got {type(template_kwargs).__name__}")
        if tools is not None and tools.spec is not None:
            self._compile_tools(tools, params, backend)
            return _CallPlan(params_at, backend, [], False, tools.spec, chat, tools, template_kwargs)
        if isinstance(items, list):
            per_item_specs, per_prompt = self._split_specs(len(items), spec_args)
        else:
            per_item_specs, per_prompt = [], False
            if any(_per_prompt(k, spec_args.get(k)) for k in _SPEC_KEYS):
                raise TypeError("a list of specs (one per prompt) needs a list of prompts, not an iterator")
        shared_spec = None
        if not per_prompt:
            shared_spec = self.make_spec(**spec_args)  # a bad shared spec raises here
            if shared_spec is not None:
                # ... and fails before any model work (under the longest compile deadline asked
                # for); a grounded one with an empty source: its shape is what can fail here
                checked = with_grounding(shared_spec, grounding, ("",))
                self.grammar.compile(checked, backend, _compile_timeout(params))
        elif grounding is not None and grounding.all_strings:
            for args in per_item_specs:  # grounded=True needs JSON Schemas, whichever item
                with_grounding(self.make_spec(**args), grounding, ("",))
        return _CallPlan(
            params_at, backend, per_item_specs, per_prompt, shared_spec, chat, tools, template_kwargs, grounding
        )

    def _tool_plan(
        self, chat: bool, tool_args: dict[str, Any], spec_args: dict[str, Any], backend: str | None
    ) -> ToolPlan | None:
        """The call's tools (tools/), checked: ValueError naming a bad tool, choice or mix."""
        if all(tool_args.get(k) is None for k in _TOOL_KEYS):
            return None
        if not chat:
            raise TypeError("tools need a chat (chat(), or generate_iter(chat=True)), not raw prompts")
        from .tools import ToolPlan

        plan = ToolPlan.make(
            tool_args.get("tools"), tool_args.get("tool_choice"), tool_args.get("parallel_tool_calls"), self.tokenizer
        )
        if plan is None or plan.spec is None:
            return plan
        given = [k for k in _SPEC_KEYS if spec_args.get(k) is not None]
        if given and not (given == ["response_format"] and spec_args["response_format"].get("type") == "text"):
            raise GrammarError(
                f"tool_choice={plan.choice!r} constrains the output to tool calls (or text): give no "
                f"{', '.join(given)} with it (or tool_choice='none')"
            )
        if (backend or self.grammar.default_backend) != "llguidance":
            raise GrammarError(
                "tool calling needs the llguidance grammar backend: its grammar embeds each function's "
                "parameters schema in a Lark grammar (%json), which xgrammar cannot compile; use "
                "grammar_backend='llguidance' (xgrammar structural tags are not wired in yet)",
                backend=backend or self.grammar.default_backend,
            )
        return plan

    def _compile_tools(self, tools: ToolPlan, params: ParamsArg, backend: str | None) -> None:
        """Compile the tool-call grammar now (a bad parameters schema fails here, naming its function)."""
        timeout = _compile_timeout(params)
        try:
            self.grammar.compile(tools.spec, backend, timeout)
        except GrammarError as e:
            raise tools.compile_error(e, lambda spec: self.grammar.compile(spec, backend, timeout)) from e

    def _requests_for(self, plan: _CallPlan, i: int, item: Any) -> list[Request]:
        """The request(s) of item i of a call: one, or n for SamplingParams(n). A problem of
        this item alone (too long, a bad per-item spec) raises ValueError/TypeError."""
        spec = self.make_spec(**plan.per_item_specs[i]) if plan.per_prompt else plan.shared_spec
        if spec is not None and (plan.grounding is not None or marks_grounded(spec)):
            args = plan.grounding or GroundingArgs("words", False)
            spec = with_grounding(spec, args, args.source_of(i, item, plan.chat))
        ids = self.encode_chat(item, plan.tools, plan.template_kwargs) if plan.chat else self._encode_raw(item)
        p = plan.params_at(i)
        return [self.new_request(ids, p, spec, i, plan.backend, j) for j in range(p.n)]

    def _entry(self, call: Call, plan: _CallPlan, i: int, item: Any) -> Entry:
        """Item i's requests, or an error Result for a problem of item i alone (raised instead
        for a bare prompt, or with raise_on_error)."""
        try:
            return Entry(i, item, self._requests_for(plan, i, item), tools=plan.tools)
        except (ValueError, TypeError) as e:
            if call.single or call.raise_on_error:
                raise
            return Entry(i, item, error=outputs.error_result(i, e, item))

    @staticmethod
    def _params_per_item(items: Iterable[Any], params: ParamsArg) -> Callable[[int], SamplingParams]:
        """params: None, one SamplingParams, or one per item (needs a list of items)."""
        if params is None or isinstance(params, SamplingParams):
            shared = params or SamplingParams()
            shared.validate()  # again: a field may have been changed since construction
            return lambda i: shared
        if not isinstance(params, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in params):
            raise TypeError(f"params must be a SamplingParams or a list of them, got {type(params).__name__}")
        if not isinstance(items, list):
            raise TypeError("a list of SamplingParams needs a list of prompts (one per prompt)")
        if len(params) != len(items):
            raise ValueError(f"got {len(params)} SamplingParams for {len(items)} prompts; pass one, or one per prompt")
        for p in params:
            p.validate()
        return params.__getitem__

    def _encode_raw(self, item: Any) -> list[int]:
        if isinstance(item, str):
            return self.encode_prompt(item)
        if isinstance(item, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            bad = next((t for t in item if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"token id {bad} is outside the model's vocabulary (0 to {self.vocab_size - 1})")
            return list(item)  # pre-tokenized prompt
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(item).__name__}")
