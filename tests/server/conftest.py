"""The server tests' shared fixtures: the tiny model served by an AsyncEngine on a loopback
port (one per test module), and an openai client of it."""

from __future__ import annotations

import asyncio

import openai
import pytest

from .test_app import Server


@pytest.fixture(scope="module")
def tiny_served(tiny_llama_dir):
    """``build_app`` over the tiny Llama, served as "tiny", no API key."""
    from constrained_serve import AsyncEngine, Engine
    from constrained_serve.server.app import build_app

    ae = AsyncEngine(Engine(model=str(tiny_llama_dir), max_num_seqs=16))
    srv = Server(build_app(ae, "tiny"))
    yield srv
    srv.stop()
    asyncio.run(ae.aclose())


@pytest.fixture(scope="module")
def tiny_client(tiny_served):
    return openai.OpenAI(base_url=f"{tiny_served.url}/v1", api_key="none", max_retries=0, timeout=120)
