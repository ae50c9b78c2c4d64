"""Shared fixtures: the real default tokenizer (loaded once) and one manager per backend."""

from __future__ import annotations

import pytest

BACKENDS = ("llguidance", "xgrammar")
MODEL_VOCAB = 49152  # SmolLM2-135M logits width


@pytest.fixture(scope="session")
def tokenizer(default_tokenizer):
    return default_tokenizer  # the converted default model's tokenizer (see tests/conftest.py)


@pytest.fixture(scope="session")
def manager(tokenizer):
    from constrained_serve.grammar import GrammarManager

    m = GrammarManager(tokenizer, MODEL_VOCAB, max_workers=2)
    yield m
    m.close()


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param
