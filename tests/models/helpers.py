"""Shared by the model tests: our logits for a batch of prompts (chunked prefill, then one
decode step, through ModelRunner), HF transformers' logits for the same ids, and tiny random
checkpoints in a config's shapes."""

import torch

from constrained_serve.engine.batch import Batch, ScheduledChunk
from constrained_serve.engine.request import Request
from constrained_serve.models import loader
from constrained_serve.params import SamplingParams
from constrained_serve.runtime.runner import ModelRunner

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:",
    "Once upon a time, in a land far away, there lived",
]


def our_logits(folder, tok, prompts, chunk=5, pages_per_request=4):
    """Mixed batches: chunked prefill of every prompt, then one decode step each."""
    src = loader.resolve_model(str(folder))
    cfg, _ = loader.load_config_and_tokenizer(src)
    model = loader.build_model(src, cfg, torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, max(64, pages_per_request * len(prompts)), 16, torch.device("cpu"), torch.float32)
    reqs = []
    next_page = 0
    for p in prompts:
        r = Request(tok(p, add_special_tokens=False)["input_ids"], SamplingParams())
        r.pages = list(range(next_page, next_page + pages_per_request))
        next_page += pages_per_request
        reqs.append(r)
    last = {}
    while any(r.num_pending for r in reqs):
        chunks = []
        for r in reqs:
            if r.num_pending:
                n = min(chunk, r.num_pending)
                chunks.append(ScheduledChunk(r, n, sample=(n == r.num_pending)))
        chunks.sort(key=lambda c: c.num_new != 1)
        logits = runner.forward(runner.prepare(Batch(chunks)))
        for c, row in zip([c for c in chunks if c.sample], logits):
            last[c.request.request_id] = row
        for c in chunks:
            c.request.num_computed += c.num_new
    # One decode step for all, appending the greedy token.
    for r in reqs:
        r.token_ids.append(int(last[r.request_id].argmax()))
    chunks = [ScheduledChunk(r, 1, True) for r in reqs]
    dec = runner.forward(runner.prepare(Batch(chunks)))
    return reqs, [last[r.request_id] for r in reqs], dec


def hf_logits(folder, ids, gguf=None):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def save_random(tmp_path, config, tokenizer):
    """A tiny checkpoint whose biases are random too (HF initialises them to zero, which
    would hide a bias the forward leaves out)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 or name.endswith("bias"):
                p.normal_(0, 0.08)
    model.save_pretrained(str(tmp_path), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp_path))
    return tmp_path


def small_config(cls, tok, **kw):
    """A config of ``cls`` (LlamaConfig, Qwen3Config, ...) for tokenizer ``tok``: 2 layers, 64
    wide, 4 query heads over 2 KV heads; ``kw`` adds or overrides fields."""
    base = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    )
    return cls(**(base | kw))
