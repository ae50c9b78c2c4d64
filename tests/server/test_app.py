"""The OpenAI-compatible server, driven by the official ``openai`` client over loopback."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import jsonschema
import openai
import pytest

KEY = "test-key-123"
SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["ok", "n"],
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
}


class Server:
    """uvicorn on a free loopback port, in a thread of this process."""

    def __init__(self, app) -> None:
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    from constrained_serve import AsyncEngine, Engine
    from constrained_serve.server.app import build_app

    engine = Engine(model=str(tiny_llama_dir), max_num_seqs=64)
    engine.core.check_each_step = True
    ae = AsyncEngine(engine)
    srv = Server(build_app(ae, "tiny", api_key=KEY))
    yield engine, srv
    srv.stop()
    asyncio.run(ae.aclose())


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=f"{served[1].url}/v1", api_key=KEY, max_retries=0, timeout=120)


def chat(client, content="Say something", **kw):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], **kw)


@pytest.mark.timeout(120)
def test_chat_completions_models_and_health(served, client):
    engine, srv = served
    r = chat(client, max_tokens=8, temperature=0)
    [c] = r.choices
    assert r.object == "chat.completion" and c.message.role == "assistant" and c.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    again = chat(client, max_tokens=8, temperature=0)
    assert again.choices[0].message.content == c.message.content  # greedy
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the prompt came from the prefix cache
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{srv.url}/health").json() == {"status": "ok"}  # no key needed there


@pytest.mark.timeout(120)
def test_completions_several_prompts_and_n(client):
    r = client.completions.create(model="tiny", prompt=["Once upon", "The weather"], max_tokens=6, temperature=0)
    assert [c.index for c in r.choices] == [0, 1] and r.object == "text_completion"
    r = chat(client, max_tokens=6, n=3, temperature=1.0, seed=5)
    assert len(r.choices) == 3 and len({c.message.content for c in r.choices}) >= 2


@pytest.mark.timeout(120)
def test_streaming_equals_the_non_streamed_output(client):
    full = chat(client, "Tell a story", max_tokens=20, temperature=0)
    stream = chat(
        client, "Tell a story", max_tokens=20, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    text, finish, usage = "", None, None
    for ev in stream:
        if ev.choices:
            text += ev.choices[0].delta.content or ""
            finish = ev.choices[0].finish_reason or finish
        if ev.usage:
            usage = ev.usage
    assert text == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason and usage.completion_tokens == full.usage.completion_tokens
    parts = list(client.completions.create(model="tiny", prompt="Once upon", max_tokens=8, temperature=0, stream=True))
    assert (
        "".join(p.choices[0].text for p in parts if p.choices)
        == client.completions.create(model="tiny", prompt="Once upon", max_tokens=8, temperature=0).choices[0].text
    )


@pytest.mark.timeout(120)
def test_structured_outputs(client):
    rf = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    r = chat(client, "Give a thing as JSON", max_tokens=40, response_format=rf, n=2, temperature=0.7, seed=1)
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    assert r.model_dump()["usage"]["completion_tokens_details"]["forced_tokens"] > 0  # {"ok": and the rest
    r = chat(client, "{}", max_tokens=40, response_format={"type": "json_object"})
    c = r.choices[0]
    assert c.finish_reason == "length" or isinstance(json.loads(c.message.content), dict)  # a cut one says so
    r = chat(client, "Digits", max_tokens=8, extra_body={"guided_regex": "[0-9]{3}"})
    assert len(r.choices[0].message.content) == 3 and r.choices[0].message.content.isdigit()
    r = chat(client, "Pick", max_tokens=8, extra_body={"guided_choice": ["alpha", "beta"]})
    assert r.choices[0].message.content in ("alpha", "beta")
    r = chat(client, "Pick", max_tokens=8, extra_body={"structured_outputs": {"grammar": 'start: "a" | "b" "c"'}})
    assert r.choices[0].message.content in ("a", "bc")


@pytest.mark.timeout(120)
def test_logprobs(client):
    r = chat(client, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for tok in content:
        assert tok.logprob <= 0 and len(tok.top_logprobs) == 3
        assert tok.top_logprobs[0].logprob >= tok.logprob - 1e-6  # greedy: the top one


@pytest.mark.timeout(120)
def test_bad_inputs_are_400_with_an_openai_error_body(served, client):
    cases = [
        (dict(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}}), "objekt"),
        (dict(extra_body={"no_such_field": 1}), "no_such_field"),
        (dict(temperature="hot"), "temperature"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_p=0), "top_p"),
        (dict(extra_body={"functions": [{"name": "f", "parameters": {}}]}), "functions"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "strng"}}}]), "'f'"),
        (dict(extra_body={"guided_regex": "(", "max_tokens": 4}), "regex"),
        (dict(stream=True, n=2), "n must be 1"),
    ]
    for kw, words in cases:
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, **kw)
        err = e.value.body
        assert e.value.status_code == 400 and words in err["message"], (kw, err)
        assert err["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="prompt has"):
        chat(client, "word " * 5000, max_tokens=4)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{served[1].url}/v1", api_key="wrong", max_retries=0).models.list()
    assert chat(client, max_tokens=2).choices  # the server is still fine
    served[0].core.check_integrity()


@pytest.mark.timeout(240)
def test_64_concurrent_streaming_clients(served):
    engine, srv = served

    async def one(c: openai.AsyncOpenAI, i: int) -> str:
        text = ""
        stream = await c.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": f"Item {i}: give a thing"}],
            max_tokens=40,
            stream=True,
            response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}},
        )
        async for ev in stream:
            if ev.choices:
                text += ev.choices[0].delta.content or ""
        return text

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0, timeout=180) as c:
            return await asyncio.gather(*[one(c, i) for i in range(64)])

    texts = asyncio.run(main())
    assert len(texts) == 64
    for t in texts:
        jsonschema.validate(json.loads(t), SCHEMA)
    assert httpx.get(f"{srv.url}/health").status_code == 200
    engine.core.check_integrity()


@pytest.mark.timeout(240)
def test_clients_that_disconnect_mid_stream_free_their_pages(served):
    engine, srv = served
    free0 = engine.pool.num_free + engine.kv.radix.evictable_pages()
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "tiny", "max_tokens": 500, "ignore_eos": True, "stream": True}

    async def leave_early(c: httpx.AsyncClient, i: int) -> None:
        msgs = [{"role": "user", "content": f"Client {i} writes a long text"}]
        async with c.stream(
            "POST", f"{srv.url}/v1/chat/completions", json={**body, "messages": msgs}, headers=headers
        ) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data:")
                if seen >= 3:
                    break  # the client goes away

    async def main() -> None:
        async with httpx.AsyncClient(timeout=120) as c:
            await asyncio.gather(*[leave_early(c, i) for i in range(20)])

    asyncio.run(main())
    deadline = time.monotonic() + 30
    while engine.core.scheduler.running or engine.core.scheduler.waiting:
        assert time.monotonic() < deadline, "requests of gone clients still run"
        time.sleep(0.05)
    engine.core.check_integrity()
    assert engine.pool.num_free + engine.kv.radix.evictable_pages() == free0


@pytest.mark.timeout(120)
def test_a_request_that_fails_while_decoding_fails_alone(served, client):
    # llguidance 1.9.1 spins after the first token of this grammar: killed at its deadline.
    hang = 'start: c y\nc: "q" | "x"\ny: "{" A B "}"\nA: /a+/\nB: /a/\n'
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(2) as pool:
        bad = pool.submit(chat, client, "Letters", max_tokens=16, extra_body={"guided_grammar": hang})
        good = pool.submit(chat, client, "Digits", max_tokens=8, extra_body={"guided_regex": "[0-9]{4}"})
        with pytest.raises(openai.BadRequestError, match="deadline") as e:
            bad.result(timeout=60)
        assert e.value.body["code"] == "GrammarError"
        assert good.result(timeout=60).choices[0].message.content.isdigit()
    assert chat(client, max_tokens=2).choices
    served[0].core.check_integrity()
