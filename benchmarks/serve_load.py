"""Serving cost (warm against warm: each side runs the workload once first, so its prefix
cache holds the prompts): 64 concurrent streaming clients of ``constrained-serve serve`` (a separate
process, over loopback, the official ``openai`` client) against the offline ``Engine.chat`` on
the same prompts and settings. Prints the aggregate output tokens/s of each, the ratio (target:
within 15%), and that every output was valid and none was lost.

    python benchmarks/serve_load.py [--clients 64] [--max-tokens 64] [--repeats 2] [--schema]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import chat_workload, median, save, source_env  # noqa: E402

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["topic", "urgent", "summary"],
    "properties": {
        "topic": {"type": "string", "maxLength": 40},
        "urgent": {"type": "boolean"},
        "summary": {"type": "string", "maxLength": 120},
    },
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, threads: int) -> subprocess.Popen:
    env = source_env()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "constrained_serve.cli",
            "serve",
            "--port",
            str(port),
            "--threads",
            str(threads),
            "--max-num-seqs",
            "64",
        ],
        env=env,
    )
    import httpx

    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("the server did not start")
        time.sleep(0.5)


async def clients(url: str, messages: list, max_tokens: int, schema: bool) -> tuple[list[str], int]:
    import openai

    extra = (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}} if schema else {}
    )

    async def one(c, msgs) -> tuple[str, int]:
        text, tokens = "", 0
        stream = await c.chat.completions.create(
            model="m",
            messages=msgs,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            **extra,
        )
        async for ev in stream:
            if ev.choices:
                text += ev.choices[0].delta.content or ""
            if ev.usage:
                tokens = ev.usage.completion_tokens
        return text, tokens

    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600) as c:
        out = await asyncio.gather(*[one(c, m) for m in messages])
    return [t for t, _ in out], sum(n for _, n in out)


def valid(texts: list[str], schema: bool) -> float:
    if not schema:
        return 1.0
    import jsonschema

    ok = 0
    for t in texts:
        try:
            jsonschema.validate(json.loads(t), SCHEMA)
            ok += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return ok / len(texts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--schema", action="store_true", help="every request with a JSON schema")
    args = ap.parse_args()
    import torch

    from constrained_serve import Engine, SamplingParams

    torch.set_num_threads(args.threads)
    messages = chat_workload(args.clients, seed=3)
    spec = {"schema": SCHEMA} if args.schema else {}
    params = SamplingParams(max_tokens=args.max_tokens)
    offline, served = [], []
    engine = Engine(max_num_seqs=64)
    engine.chat(messages, params, **spec)  # warm up: both sides then run with the prompts cached
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        rs = engine.chat(messages, params, **spec)
        dt = time.perf_counter() - t0
        n = sum(r.usage.completion_tokens for r in rs)
        offline.append((n / dt, valid([r.text for r in rs], args.schema), len(rs)))
        print(f"  offline: {dt:6.1f} s  {n / dt:6.1f} tok/s", flush=True)
    del engine
    port = free_port()
    proc = start_server(port, args.threads)
    try:
        url = f"http://127.0.0.1:{port}"
        asyncio.run(clients(url, messages, args.max_tokens, args.schema))  # warm up, as offline
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            texts, n = asyncio.run(clients(url, messages, args.max_tokens, args.schema))
            dt = time.perf_counter() - t0
            served.append((n / dt, valid(texts, args.schema), len(texts)))
            print(f"  served:  {dt:6.1f} s  {n / dt:6.1f} tok/s  ({len(texts)} of {args.clients} streams)", flush=True)
        import httpx

        healthy = httpx.get(f"{url}/health").status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    off, srv = median([x[0] for x in offline]), median([x[0] for x in served])
    print(
        f"offline {off:.1f} tok/s, served {srv:.1f} tok/s: ratio {srv / off:.2f} (target >= 0.85); "
        f"valid {min(x[1] for x in served):.0%}, streams {min(x[2] for x in served)}/{args.clients}, "
        f"server healthy after: {healthy}"
    )
    print(
        "saved",
        save(
            "serve_load",
            {
                "args": vars(args),
                "offline_tok_s": off,
                "served_tok_s": srv,
                "ratio": srv / off,
                "healthy": healthy,
                "offline": offline,
                "served": served,
            },
        ),
    )


if __name__ == "__main__":
    main()
