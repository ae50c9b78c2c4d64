"""Tool calling over the OpenAI-compatible server on the default model, driven by the
clients agents use: the openai client (each tool_choice, streaming, parse with
pydantic_function_tool, an agent loop), instructor and langchain-openai."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from .test_app import KEY, Server

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "maxLength": 60}},
                "required": ["query"],
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def called(name: str, args: dict, i: int) -> dict:
    call = {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


# Earlier turns where the assistant called tools: the 135M model then calls them where they fit.
FEW_SHOT = [
    {"role": "user", "content": "What is the weather in Rome?"},
    called("get_weather", {"city": "Rome"}, 0),
    {"role": "user", "content": "Search the web for cheap hotels."},
    called("search", {"query": "cheap hotels"}, 1),
    {"role": "user", "content": "And the weather in Lima, in fahrenheit?"},
    called("get_weather", {"city": "Lima", "unit": "fahrenheit"}, 2),
]


class Person(BaseModel):  # no additionalProperties in its schema
    name: str = Field(max_length=30)
    age: int = Field(ge=0, le=120)


def _client_library(name: str):
    """A client library the tests drive the server with (a test dependency: make setup)."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as e:
        pytest.fail(f"{name} is missing ({e}): `make setup` installs the test dependencies")


@pytest.fixture(scope="module")
def served(default_engine):
    from constrained_serve import AsyncEngine
    from constrained_serve.server.app import build_app

    ae = AsyncEngine(default_engine)
    srv = Server(build_app(ae, "smol", api_key=KEY))
    yield default_engine, srv
    srv.stop()
    asyncio.run(ae.aclose())


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=f"{served[1].url}/v1", api_key=KEY, max_retries=0, timeout=300)


def ask(client, content, history=(), **kw):
    kw.setdefault("max_tokens", 80)
    kw.setdefault("tools", TOOLS)
    return client.chat.completions.create(model="smol", messages=[*history, {"role": "user", "content": content}], **kw)


def check_calls(message) -> list:
    assert message.tool_calls
    for c in message.tool_calls:
        assert c.type == "function" and c.id.startswith("call_")
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    return message.tool_calls


@pytest.mark.timeout(600)
def test_each_tool_choice(client):
    r = ask(client, "What is the weather in Paris?", FEW_SHOT, temperature=0)  # auto: the model calls
    [c] = r.choices
    assert c.finish_reason == "tool_calls" and [t.function.name for t in check_calls(c.message)] == ["get_weather"]
    r = ask(client, "Tell me a joke.", tool_choice="required", parallel_tool_calls=False, temperature=1.0, n=2)
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and len(check_calls(c.message)) == 1
    named = {"type": "function", "function": {"name": "search"}}
    r = ask(client, "Hello", tool_choice=named, temperature=1.0)  # one call by default
    assert [t.function.name for t in check_calls(r.choices[0].message)] == ["search"]
    assert r.choices[0].message.content is None
    r = ask(client, "Hello", tool_choice="none", max_tokens=10)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    for kw, words in [
        (dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "nope"),
        (dict(tool_choice="sometimes"), "tool_choice"),
        (
            dict(
                tools=[
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type": "strng"}}},
                        },
                    }
                ]
            ),
            "'f'",
        ),
        (dict(extra_body={"functions": [{"name": "f"}]}), "functions"),
    ]:
        with pytest.raises(openai.BadRequestError, match=words):
            ask(client, "x", **kw)


@pytest.mark.timeout(600)
def test_streamed_tool_calls(client):
    def stream(content, **kw):
        text, calls, finish = "", {}, None
        pieces = 0
        for ev in ask(client, content, FEW_SHOT, stream=True, temperature=0, **kw):
            d = ev.choices[0].delta
            text += d.content or ""
            for t in d.tool_calls or []:
                entry = calls.setdefault(t.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = t.id or entry["id"]
                entry["name"] += (t.function.name or "") if t.function else ""
                entry["arguments"] += (t.function.arguments or "") if t.function else ""
                pieces += bool(t.function and t.function.arguments)
            finish = ev.choices[0].finish_reason or finish
        assert not calls or pieces > len(calls)  # arguments arrive as they are written, not at the end
        return text, calls, finish

    text, calls, finish = stream("What is the weather in Oslo?")
    full = ask(client, "What is the weather in Oslo?", FEW_SHOT, temperature=0).choices[0]
    assert finish == "tool_calls" and text == (full.message.content or "")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (t.function.name, json.loads(t.function.arguments)) for t in full.message.tool_calls
    ]
    assert all(c["id"].startswith("call_") for c in calls.values())
    text, calls, finish = stream("Thanks! Now tell me a joke.", tool_choice="none")
    assert not calls and text and finish in ("stop", "length")


@pytest.mark.timeout(600)
def test_parse_with_a_pydantic_function_tool(client):
    r = client.chat.completions.parse(
        model="smol",
        messages=[{"role": "user", "content": "Ann is 34. Record her."}],
        tools=[openai.pydantic_function_tool(Person)],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        max_tokens=80,
    )
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "Person" and isinstance(call.function.parsed_arguments, Person)


@pytest.mark.timeout(600)
def test_a_two_turn_agent_loop(client):
    """Call, tool result, final answer: the tool message goes back through the template."""
    messages = [*FEW_SHOT, {"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model="smol", messages=messages, tools=TOOLS, temperature=0, max_tokens=80)
    [call] = check_calls(r.choices[0].message)
    messages.append(r.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "18 C, cloudy"})
    r = client.chat.completions.create(model="smol", messages=messages, tools=TOOLS, temperature=0, max_tokens=60)
    final = r.choices[0]
    assert final.finish_reason == "stop" and final.message.tool_calls is None and final.message.content


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor(served, mode):
    instructor = _client_library("instructor")
    client = instructor.from_openai(
        openai.OpenAI(base_url=f"{served[1].url}/v1", api_key=KEY, max_retries=0, timeout=300),
        mode=getattr(instructor.Mode, mode),
    )
    assert "additionalProperties" not in json.dumps(Person.model_json_schema())
    for i in range(8):
        person = client.chat.completions.create(
            model="smol",
            response_model=Person,
            messages=[{"role": "user", "content": f"Make up person number {i}."}],
            temperature=1.0,
            max_tokens=80,
            max_retries=0,  # every call's first answer validates
        )
        assert isinstance(person, Person)


@pytest.mark.timeout(900)
def test_langchain_openai(served):
    _client_library("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model="smol", base_url=f"{served[1].url}/v1", api_key=KEY, temperature=0, max_tokens=80, max_retries=0
    )
    with_tools = llm.bind_tools(TOOLS)
    messages = [HumanMessage("What is the weather in Paris? Call get_weather.")]
    ai = llm.bind_tools(TOOLS, tool_choice="get_weather").invoke(messages)
    [call] = ai.tool_calls
    jsonschema.validate(call["args"], WEATHER)
    answer = with_tools.invoke([*messages, ai, ToolMessage("18 C, cloudy", tool_call_id=call["id"])])
    assert isinstance(answer.content, str)
    for method in ("function_calling", "json_schema"):
        person = llm.with_structured_output(Person, method=method).invoke("Ann is 34. Who is she?")
        assert isinstance(person, Person), method
    value = llm.with_structured_output(Person.model_json_schema(), method="json_mode").invoke(
        "Ann is 34. Answer in JSON with her name and age."
    )
    assert isinstance(value, dict)


# ------------------------------------------------------------------ /v1/responses with tools

RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses API's flat shape


def responses_history() -> list[dict]:
    """FEW_SHOT as Responses input items: the assistant's calls are function_call items."""
    items = []
    for m in FEW_SHOT:
        if m["role"] == "user":
            items.append({"role": "user", "content": m["content"]})
        for c in m.get("tool_calls") or []:
            fn = c["function"]
            items.append(
                {"type": "function_call", "call_id": c["id"], "name": fn["name"], "arguments": fn["arguments"]}
            )
    return items


def calls_of(response) -> list:
    calls = [o for o in response.output if o.type == "function_call"]
    for c in calls:
        assert c.call_id.startswith("call_") and c.id.startswith("fc_") and c.status == "completed"
        jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])
    return calls


@pytest.mark.timeout(600)
def test_responses_function_tools(client):
    def create(content, **kw):
        kw.setdefault("tools", RESPONSES_TOOLS)
        kw.setdefault("max_output_tokens", 80)
        return client.responses.create(
            model="smol", input=[*responses_history(), {"role": "user", "content": content}], **kw
        )

    r = create("What is the weather in Paris?", temperature=0)  # auto
    assert [c.name for c in calls_of(r)] == ["get_weather"] and r.status == "completed"
    r = create("Hello", tool_choice={"type": "function", "name": "search"}, temperature=1.0)
    assert [o.type for o in r.output] == ["function_call"] and [c.name for c in calls_of(r)] == ["search"]
    r = create("Tell me a joke.", tool_choice="required", parallel_tool_calls=False, temperature=1.0)
    assert len(calls_of(r)) == 1
    r = create("Hello", tool_choice="none", max_output_tokens=10)
    assert not calls_of(r) and r.output[0].type == "message"

    # a two-turn loop: the call and its output go back as input items
    first = create("What is the weather in Paris?", temperature=0)
    [call] = calls_of(first)
    history = [*responses_history(), {"role": "user", "content": "What is the weather in Paris?"}]
    history += [
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, cloudy"},
    ]
    r = client.responses.create(model="smol", input=history, tools=RESPONSES_TOOLS, temperature=0, max_output_tokens=60)
    assert not calls_of(r) and r.output_text

    # streamed: text events, then the call as it is written
    events = list(
        client.responses.create(
            model="smol",
            input=[*responses_history(), {"role": "user", "content": "What is the weather in Oslo?"}],
            tools=RESPONSES_TOOLS,
            temperature=0,
            max_output_tokens=80,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    final = events[-1].response
    [item] = calls_of(final)
    assert len(deltas) > 1 and "".join(deltas) == done.arguments == item.arguments
    assert [e.sequence_number for e in events] == list(range(len(events)))

    with pytest.raises(openai.BadRequestError, match="web_search"):
        client.responses.create(model="smol", input="x", tools=[{"type": "web_search"}])
