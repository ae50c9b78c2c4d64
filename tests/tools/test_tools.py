"""Tool calling's parts without a model: the call formats, the grammar of each tool_choice
(run through llguidance on the default tokenizer), the parser, the prompt and the plan."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from constrained_serve.errors import OutputValidationError
from constrained_serve.tools import ToolPlan
from constrained_serve.tools.formats import DEFAULT, HERMES, LLAMA3_JSON, format_for_template
from constrained_serve.tools.grammar import tool_grammar
from constrained_serve.tools.parse import parse_tool_calls, split_calls
from constrained_serve.tools.prompt import rewritten

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now"}},
]
NO_TOOLS_TEMPLATE = SimpleNamespace(chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")


@pytest.fixture(scope="module")
def accepts(default_tokenizer):
    """accepts(grammar, text): does llguidance take the whole text and may it end there?"""
    import llguidance.hf
    from llguidance import LLMatcher

    tok = llguidance.hf.from_tokenizer(default_tokenizer)

    def run(grammar: str, text: str) -> bool:
        m = LLMatcher(tok, LLMatcher.grammar_from_lark(grammar), log_level=1)
        assert not m.is_error(), m.get_error()
        ids = tok.tokenize_str(text)
        return m.try_consume_tokens(ids) == len(ids) and not m.is_error() and m.is_accepting()

    return run


def call(name: str, args: dict, fmt=HERMES) -> str:
    return fmt.write(name, args)


def test_formats_are_picked_from_the_template():
    assert format_for_template(NO_TOOLS_TEMPLATE) is DEFAULT
    hermes = SimpleNamespace(chat_template="{% if tools %}<tool_call>{% endif %}")
    llama = SimpleNamespace(
        chat_template='{% if tools %}{"name": function name, "parameters": dictionary of argument name{% endif %}'
    )
    assert format_for_template(hermes) is HERMES and format_for_template(llama) is LLAMA3_JSON
    assert format_for_template(SimpleNamespace(chat_template="{{ tools }} something else")) is DEFAULT
    assert call("f", {"a": 1}) == '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    assert call("f", {}, LLAMA3_JSON) == '{"name": "f", "parameters": {}}'


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON], ids=lambda f: f.name)
def test_each_tool_choice_grammar_takes_exactly_its_outputs(accepts, fmt):
    fns = [("get_weather", dict(WEATHER, additionalProperties=False)), ("now", {"type": "object", "properties": {}})]
    good = call("get_weather", {"city": "Paris"}, fmt)
    two = good + fmt.separator + call("now", {}, fmt)
    auto = tool_grammar(fns, fmt, "auto", parallel=True)
    assert accepts(auto, "Just text, no call.") and accepts(auto, good) and accepts(auto, two)
    assert accepts(auto, "Let me look. " + good)  # text, then calls
    assert not accepts(auto, good + " and text after")
    assert not accepts(auto, call("get_weather", {"town": "Paris"}, fmt))  # not its parameters
    assert not accepts(auto, call("get_weather", {"city": 3}, fmt))
    assert not accepts(auto, call("nope", {}, fmt))
    assert not accepts(auto, "Hi " + fmt.marker + " there")  # the marker commits to a call
    if fmt.start:
        assert not accepts(auto, good.replace('": ', '":'))  # one spelling of the call
    single = tool_grammar(fns, fmt, "auto", parallel=False)
    assert accepts(single, good) and not accepts(single, two)
    required = tool_grammar(fns, fmt, "required", parallel=True)
    assert accepts(required, good) and accepts(required, two) and not accepts(required, "text")
    assert not accepts(required, good.replace('y": ', 'y":'))  # one spelling of the arguments
    named = tool_grammar(fns[:1], fmt, "required", parallel=False)
    assert accepts(named, good) and not accepts(named, call("now", {}, fmt)) and not accepts(named, two)


def test_parse_reads_content_and_calls_and_validates():
    params = {"get_weather": dict(WEATHER, additionalProperties=False), "now": {"type": "object"}}
    text = "Checking. " + call("get_weather", {"city": "Oslo", "unit": "c"}) + "\n" + call("now", {})
    content, calls = parse_tool_calls(text, HERMES, params)
    assert content == "Checking. " and [c.name for c in calls] == ["get_weather", "now"]
    assert calls[0].arguments == {"city": "Oslo", "unit": "c"} and json.loads(calls[0].arguments_json) == {
        "city": "Oslo",
        "unit": "c",
    }
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id
    assert calls[0].to_openai()["function"] == {"name": "get_weather", "arguments": calls[0].arguments_json}
    assert parse_tool_calls("plain", HERMES, params) == ("plain", [])
    with pytest.raises(OutputValidationError, match="unit"):
        parse_tool_calls(call("get_weather", {"city": "x", "unit": "k"}), HERMES, params)
    with pytest.raises(ValueError):
        split_calls(call("now", {}) + "junk", HERMES)


def test_plan_checks_tools_and_choice():
    tok = NO_TOOLS_TEMPLATE
    plan = ToolPlan.make(TOOLS, None, None, tok)
    assert plan.choice == "auto" and plan.parallel and plan.spec.kind == "lark"
    assert plan.parameters["get_weather"]["additionalProperties"] is False  # closed
    assert plan.parameters["now"] == {"type": "object", "properties": {}, "additionalProperties": False}
    assert ToolPlan.make(TOOLS, "none", None, tok).spec is None
    named = ToolPlan.make(TOOLS, {"type": "function", "function": {"name": "now"}}, False, tok)
    assert named.choice == "now" and "get_weather" not in named.spec.text
    assert ToolPlan.make(None, None, None, tok) is None
    for tools, choice, words in [
        (TOOLS, "sometimes", "tool_choice must be"),
        (TOOLS, {"type": "function", "function": {"name": "other"}}, "not among the tools"),
        ([{"type": "retrieval"}], None, "type 'function'"),
        ([{"type": "function", "function": {"name": "bad name"}}], None, "function.name"),
        ([TOOLS[0], TOOLS[0]], None, "two functions"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], None, "object"),
        (None, "required", "needs tools"),
    ]:
        with pytest.raises(ValueError, match=words):
            ToolPlan.make(tools, choice, None, tok)


def test_a_round_trip_renders_for_a_template_without_tools():
    history = [
        {"role": "user", "content": "Weather in Oslo and the time?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                },
                {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
    ]
    out = rewritten(history, ToolPlan.make(TOOLS, None, None, NO_TOOLS_TEMPLATE).tools, HERMES)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert '"name": "get_weather"' in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert out[2]["content"] == call("get_weather", {"city": "Oslo"}) + "\n" + call("now", {})
    assert out[3]["content"] == "<tool_response>\n12 C\n</tool_response>\n<tool_response>\nnoon\n</tool_response>"


HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
    "<|im_end|>\n{%- endif %}{%- for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}"
    "{% for c in m.tool_calls %}<tool_call>\n"
    '{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}'
    "\n</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_takes_tools_renders_them_itself(default_tokenizer):
    import copy

    from constrained_serve.inputs import RequestBuilder

    tok = copy.copy(default_tokenizer)
    tok.chat_template = HERMES_TEMPLATE
    plan = ToolPlan.make(TOOLS, "auto", None, tok)
    assert plan.takes_tools and plan.fmt is HERMES
    history = [
        {"role": "user", "content": "Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "12 C"},
    ]
    text = RequestBuilder(tok, len(tok), 4096, grammar=lambda: None).render_chat(history, tools=plan)
    assert text.startswith('<|im_start|>system\n<tools>{"type": "function", "function": {"name": "get_weather"')
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in text  # arguments as an object
    assert "<|im_start|>tool\n12 C<|im_end|>" in text and "# Tools" not in text  # not our default prompt
