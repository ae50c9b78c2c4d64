"""Issue #41, the server: nothing a client sends gets past a clear OpenAI error. Size limit,
served model name, error shapes, vLLM fields, and a bounded, seeded fuzz of the HTTP surface."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from .test_app import Server

MAX_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def hserved(tiny_llama_dir):
    from constrained_serve import AsyncEngine, Engine
    from constrained_serve.server.app import build_app

    engine = Engine(model=str(tiny_llama_dir), max_num_seqs=16, max_model_len=256)
    ae = AsyncEngine(engine)
    srv = Server(build_app(ae, "tiny", max_request_bytes=MAX_BYTES))
    yield engine, srv
    srv.stop()
    asyncio.run(ae.aclose())


def _is_openai_error(r: httpx.Response, status: int | None = None) -> dict:
    body = r.json()
    assert set(body) == {"error"} and isinstance(body["error"]["message"], str), body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    if status is not None:
        assert r.status_code == status, (r.status_code, body)
    return body["error"]


def _post(url: str, content: bytes, **headers: str) -> httpx.Response:
    return httpx.post(url, content=content, headers={"content-type": "application/json", **headers}, timeout=60)


@pytest.mark.timeout(120)
def test_request_size_limit_is_413_before_reading(hserved):
    _, srv = hserved
    big = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x" * (MAX_BYTES + 10)}]}).encode()
    t0 = time.monotonic()
    err = _is_openai_error(_post(f"{srv.url}/v1/chat/completions", big), 413)
    assert time.monotonic() - t0 < 2 and "--max-request-bytes" in err["message"]

    def chunks():  # no Content-Length: refused once the bytes read pass the limit
        yield big[: MAX_BYTES // 2]
        yield big[MAX_BYTES // 2 :]

    r = httpx.post(f"{srv.url}/v1/chat/completions", content=chunks(), timeout=60)
    _is_openai_error(r, 413)


@pytest.mark.timeout(120)
def test_a_prompt_longer_than_the_context_is_not_tokenized(hserved):
    engine, srv = hserved
    text = "word " * 12000  # 60 KB: under the size limit, far over 256 tokens
    seen = []
    orig = type(engine.inputs.tokenizer).__call__

    def watched(self, text_, *a, **kw):
        seen.append(len(text_) if isinstance(text_, str) else 0)
        return orig(self, text_, *a, **kw)

    type(engine.inputs.tokenizer).__call__ = watched
    try:
        r = _post(
            f"{srv.url}/v1/chat/completions",
            json.dumps({"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 2}).encode(),
        )
    finally:
        type(engine.inputs.tokenizer).__call__ = orig
    err = _is_openai_error(r, 400)
    assert "prompt has at least" in err["message"] and not any(n > 50000 for n in seen)


@pytest.mark.timeout(120)
def test_served_model_name_and_unknown_models(hserved):
    _, srv = hserved
    assert [m["id"] for m in httpx.get(f"{srv.url}/v1/models").json()["data"]] == ["tiny"]
    for model in ("gpt-9", "../../../../etc/passwd"):
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        err = _is_openai_error(httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60), 404)
        assert err["code"] == "model_not_found" and err["param"] == "model"
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices


def test_default_served_name_is_no_path():
    from types import SimpleNamespace

    from constrained_serve.server.limits import default_served_name

    def eng(model, path):
        return SimpleNamespace(engine=SimpleNamespace(config=SimpleNamespace(model=model)), model_path=path)

    assert default_served_name(eng("HuggingFaceTB/SmolLM2-135M-Instruct", "/c/snap/abc")) == "SmolLM2-135M-Instruct"
    assert default_served_name(eng(None, "/home/u/.cache/cs/smollm2-135m/")) == "smollm2-135m"
    assert default_served_name(eng("/models/qwen.Q4.gguf", "/models/qwen.Q4.gguf")) == "qwen.Q4"


@pytest.mark.timeout(120)
def test_every_error_has_the_openai_shape(hserved):
    _, srv = hserved
    url = f"{srv.url}/v1/chat/completions"
    cases = [
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, "UTF-8"),
        (b"[" * 5000 + b"]" * 5000, 400, "deeper"),
        (b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}', 400, "surrogate"),
        (b'{"messages": [', 400, "not valid JSON"),
        (b'{"messages": "hi"}', 400, "messages"),
        (b"", 400, None),
    ]
    for body, status, words in cases:
        err = _is_openai_error(_post(url, body), status)
        assert words is None or words in err["message"], (body[:40], err)
    err = _is_openai_error(httpx.post(f"{srv.url}/v1/embeddings", json={"input": "x"}), 404)
    assert "/v1/embeddings" in err["message"]
    _is_openai_error(httpx.get(url), 405)


@pytest.mark.timeout(120)
def test_vllm_fields(hserved):
    _, srv = hserved
    c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": "Pick"}]
    for extra in ({"guided_grammar": 'root ::= "a" | "b" "c"'}, {"structured_outputs": {"grammar": 'root ::= "yes"'}}):
        r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, extra_body=extra)
        assert r.choices[0].message.content in ("a", "bc", "yes")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for pattern in ("", "[ \\n\\t]*"):
        r = c.chat.completions.create(
            model="tiny",
            messages=msgs,
            max_tokens=30,
            extra_body={"guided_json": schema, "guided_whitespace_pattern": pattern},
        )
        assert r.choices
    with pytest.raises(openai.BadRequestError, match="guided_whitespace_pattern"):
        c.chat.completions.create(
            model="tiny", messages=msgs, max_tokens=2, extra_body={"guided_whitespace_pattern": "x+"}
        )
    r = c.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=2, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert r.choices
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
        c.chat.completions.create(
            model="tiny", messages=msgs, max_tokens=2, extra_body={"chat_template_kwargs": {"messages": []}}
        )


def test_chat_template_kwargs_reach_the_template(default_tokenizer):
    from constrained_serve.inputs import RequestBuilder

    b = RequestBuilder(default_tokenizer, 10, 100, lambda: None)
    b.tokenizer = type("T", (), {"apply_chat_template": lambda self, m, **kw: json.dumps(sorted(kw))})()
    assert "enable_thinking" in b.render_chat(
        [{"role": "user", "content": "x"}], template_kwargs={"enable_thinking": 0}
    )


# ------------------------------------------------------------------------------ fuzz

_BASE = [
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}),
    ("/v1/completions", {"model": "tiny", "prompt": "Once", "max_tokens": 3}),
    ("/v1/responses", {"model": "tiny", "input": "Hi", "max_output_tokens": 3}),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "JSON"}],
            "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "object"}}},
        },
    ),
    ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2, "extra_body": 1, "guided_regex": "[0-9]{2}"}),
]
_VALUES = [
    None, True, False, 0, -1, 1, 2, 3, 2**31, 2**64, -(2**63), 1e308, -0.0, 0.5, float("nan"), "", "x", "\ud800",
    "\u0000", "🯸" * 3, "a" * 3000, [], [1], [[1, 2]], {}, {"type": "x"}, {"role": "user"}, [{"role": "user"}],
    {"a": {"b": {"c": [1]}}}, "tiny", "gpt-9", "[0-9]", "(", 'root ::= "a"', "start: /a+/",
]  # fmt: skip
_KEYS = ["model", "messages", "prompt", "input", "max_tokens", "temperature", "top_p", "n", "stream", "stop", "seed",
         "response_format", "guided_json", "guided_regex", "guided_grammar", "guided_choice", "logprobs",
         "top_logprobs", "structured_outputs", "chat_template_kwargs", "guided_whitespace_pattern", "unknown_field",
         "tools", "max_output_tokens", "text", "stream_options", "logit_bias", "stop_token_ids", "echo"]  # fmt: skip


def _mutate(rng: random.Random, body: dict) -> dict:
    body = json.loads(json.dumps(body))
    for _ in range(rng.randint(1, 3)):
        op = rng.random()
        if op < 0.45:
            body[rng.choice(_KEYS)] = rng.choice(_VALUES)
        elif op < 0.6 and body:
            body.pop(rng.choice(list(body)))
        elif op < 0.75 and "messages" in body and isinstance(body["messages"], list) and body["messages"]:
            m = body["messages"][0]
            if isinstance(m, dict):
                m[rng.choice(["role", "content", "name", "x"])] = rng.choice(_VALUES)
        else:
            k = rng.choice(list(body) or ["x"])
            v = {"v": None}
            for _ in range(rng.choice([1, 5, 50, 200])):
                v = [v] if rng.random() < 0.5 else {"k": v}
            body[k] = v
    body["max_tokens"] = body["max_tokens"] if isinstance(body.get("max_tokens"), (int, float)) else 3
    for key in ("max_tokens", "max_output_tokens"):  # bound the time (the context, 256, bounds it anyway)
        if isinstance(body.get(key), (int, float)) and body[key] > 4:
            body[key] = 4
    if isinstance(body.get("n"), int) and body["n"] > 2:
        body["n"] = 2
    return body


FUZZ_CASES = 3000


def _encode(rng: random.Random, body: dict) -> bytes:
    raw = json.dumps(body, ensure_ascii=rng.random() < 0.5, allow_nan=True).encode("utf-8", "surrogatepass")
    x = rng.random()
    if x < 0.05:
        i = rng.randrange(len(raw))
        raw = raw[:i] + bytes([rng.randrange(256)]) + raw[i + 1 :]  # a flipped byte
    elif x < 0.08:
        raw = raw[: rng.randrange(len(raw))]  # cut short
    elif x < 0.1:
        raw = raw + b"\xc3"  # invalid UTF-8 at the end
    return raw


def _rss_and_threads() -> tuple[int, int]:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["VmRSS"].split()[0]) * 1024, threading.active_count()


@pytest.mark.timeout(300)
def test_fuzz_the_http_surface(hserved):
    engine, srv = hserved
    assert srv.url.startswith("http://127.0.0.1:")
    rng = random.Random(41)
    cases = []
    for _ in range(FUZZ_CASES):
        path, base = rng.choice(_BASE)
        cases.append((path, _encode(rng, _mutate(rng, base))))
    with httpx.Client(timeout=60) as c:  # warm up: the grammar workers, the first requests
        c.post(f"{srv.url}/v1/chat/completions", json=_BASE[3][1])
    rss0, threads0 = _rss_and_threads()
    statuses: dict[int, int] = {}
    bad: list[tuple] = []

    client = httpx.Client(timeout=60, limits=httpx.Limits(max_connections=8))  # kept-alive connections, shared

    def one(case: tuple[str, bytes]) -> None:
        path, raw = case
        c = client
        if b'"stream": true' in raw or b'"stream":true' in raw:
            with c.stream("POST", f"{srv.url}{path}", content=raw, headers={"content-type": "application/json"}) as r:
                r.read()
        else:
            r = c.post(f"{srv.url}{path}", content=raw, headers={"content-type": "application/json"})
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        if r.status_code >= 500:
            bad.append((path, raw[:300], r.text[:300]))
        elif r.status_code != 200:
            try:
                _is_openai_error(r)
            except (AssertionError, ValueError) as e:
                bad.append((path, raw[:300], r.status_code, r.text[:300], str(e)[:100]))

    t0 = time.monotonic()
    with client, ThreadPoolExecutor(8) as pool:
        list(pool.map(one, cases))
    elapsed = time.monotonic() - t0
    assert not bad, bad[:5]
    assert statuses.get(200, 0) > 50 and sum(v for k, v in statuses.items() if k >= 400) > 500, statuses
    rss1, threads1 = _rss_and_threads()
    assert rss1 - rss0 < 600 * 2**20, (rss0, rss1)
    assert threads1 <= threads0 + 16, (threads0, threads1)
    assert httpx.get(f"{srv.url}/health", timeout=5).json() == {"status": "ok"}
    engine.core.check_integrity()
    assert elapsed < 240
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5):
        pass


# ------------------------------------------------------------------- start-up line and access log


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(240)
def test_serve_prints_where_it_listens_and_an_access_log_unless_quiet(tiny_llama_dir):
    """`constrained-serve serve` as a user starts it: one start-up line (model, served name,
    address), one access-log line per request; nothing of either with --quiet."""
    import subprocess
    import sys

    from ..helpers import subprocess_env

    runs = {}
    for quiet in (False, True):
        port = _free_port()
        argv = [
            sys.executable,
            "-m",
            "constrained_serve.cli",
            "serve",
            "--model",
            str(tiny_llama_dir),
            "--port",
            str(port),
        ]
        argv += ["--served-model-name", "tiny", "--max-num-seqs", "4"] + (["--quiet"] if quiet else [])
        proc = subprocess.Popen(argv, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        runs[quiet] = (proc, port)
    try:
        for proc, port in runs.values():
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    assert proc.poll() is None, proc.stdout.read()
                    time.sleep(0.3)
            r = httpx.post(f"http://127.0.0.1:{port}/v1/models/nope", timeout=10)  # any request: logged as it went
            assert r.status_code in (404, 405)
    finally:
        for proc, _ in runs.values():
            proc.terminate()
    loud, quiet_out = (runs[q][0].communicate(timeout=60)[0] for q in (False, True))
    port = runs[False][1]
    assert f"serving tiny (model {tiny_llama_dir}) on http://127.0.0.1:{port}/v1" in loud, loud
    assert '"GET /health HTTP/1.1" 200' in loud and "/v1/models/nope" in loud, loud
    assert "serving" not in quiet_out and "GET /health" not in quiet_out, quiet_out
