"""Our forward (llama.py, run by ModelRunner) equals HF transformers' for the same weights
(fp32): tiny Llama and Qwen3, long prefill chunks, the default model against HF's own GGUF
loader, config variants (biases, activations, sliding window), and the engine end to end
(benchmarks/gpu_correctness.py at a tiny shape)."""

import pytest
import torch

from constrained_serve.kernels import long_chunks
from constrained_serve.models import loader
from constrained_serve.params import SamplingParams

from .helpers import PROMPTS, hf_logits, our_logits, save_random, small_config


@pytest.mark.parametrize("which", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_tiny_logits_match_hf(which, request, default_tokenizer):
    folder = request.getfixturevalue(which)
    reqs, prefill, decode = our_logits(folder, default_tokenizer, PROMPTS)
    for r, pre, dec in zip(reqs, prefill, decode):
        ref = hf_logits(folder, r.token_ids)
        assert (pre - ref[-2]).abs().max().item() < 1e-4
        assert (dec - ref[-1]).abs().max().item() < 1e-4


def test_long_prefill_chunks_match_hf(tiny_llama_dir, default_tokenizer, monkeypatch):
    """Prefill chunks of 200 tokens over up to 400 keys take the per-head oneDNN attention
    (fp32 on CPU, kernels/long_chunks.py); the logits still equal HF's."""
    calls = []
    monkeypatch.setattr(long_chunks, "HEAD_BLOCK_ROWS", 96)  # several causal blocks per chunk
    per_head = long_chunks._attend_per_head
    monkeypatch.setattr(long_chunks, "_attend_per_head", lambda *a: calls.append(1) or per_head(*a))
    prompts = [" ".join(f"item{i} costs {i % 17} euros" for i in range(n)) for n in (60, 75)]
    reqs, prefill, decode = our_logits(tiny_llama_dir, default_tokenizer, prompts, chunk=200, pages_per_request=40)
    assert calls, "the per-head path did not run"
    assert min(r.num_prompt for r in reqs) > 300
    for r, pre, dec in zip(reqs, prefill, decode):
        ref = hf_logits(tiny_llama_dir, r.token_ids)
        assert (pre - ref[-2]).abs().max().item() < 1e-4
        assert (dec - ref[-1]).abs().max().item() < 1e-4


@pytest.mark.slow
def test_default_model_logits_match_hf_gguf(default_model_dir, default_tokenizer):
    """Against HF's own GGUF loader (independent dequantization and q/k un-permutation)."""
    from transformers import AutoModelForCausalLM

    gguf = loader.default_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    reqs, prefill, decode = our_logits(default_model_dir, default_tokenizer, PROMPTS)
    for r, pre, dec in zip(reqs, prefill, decode):
        with torch.no_grad():
            ref = hf(torch.tensor([r.token_ids])).logits[0]
        assert (pre - ref[-2]).abs().max().item() < 1e-3
        assert (dec - ref[-1]).abs().max().item() < 1e-3
        assert int(pre.argmax()) == int(ref[-2].argmax())
        assert int(dec.argmax()) == int(ref[-1].argmax())


@pytest.mark.parametrize("variant", ["llama_biases_gelu", "qwen2_biases", "qwen3_attention_bias"])
def test_config_variants_match_hf(variant, tmp_path, default_tokenizer):
    """o_proj and MLP biases (attention_bias, mlp_bias) and hidden_act were read from the
    config but not used: the outputs differed from HF's with no error."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    cfg = {
        "llama_biases_gelu": lambda: small_config(
            LlamaConfig, default_tokenizer, attention_bias=True, mlp_bias=True, hidden_act="gelu_pytorch_tanh"
        ),
        "qwen2_biases": lambda: small_config(Qwen2Config, default_tokenizer),
        "qwen3_attention_bias": lambda: small_config(Qwen3Config, default_tokenizer, attention_bias=True, head_dim=32),
    }[variant]()
    folder = save_random(tmp_path, cfg, default_tokenizer)
    reqs, prefill, decode = our_logits(folder, default_tokenizer, PROMPTS[:2])
    for r, pre, dec in zip(reqs, prefill, decode):
        ref = hf_logits(folder, r.token_ids)
        assert (pre - ref[-2]).abs().max().item() < 1e-4
        assert (dec - ref[-1]).abs().max().item() < 1e-4


def test_sliding_window_caps_the_context(tmp_path, default_tokenizer):
    """We attend to the whole context, which equals windowed attention up to the window."""
    from transformers import MistralConfig

    from constrained_serve import Engine

    folder = save_random(tmp_path, small_config(MistralConfig, default_tokenizer, sliding_window=32), default_tokenizer)
    eng = Engine(model=str(folder), kv_cache_tokens=256)
    assert eng.max_model_len == 32
    [r] = eng.generate([list(range(5, 25))], SamplingParams(max_tokens=50, ignore_eos=True))
    assert r.finish_reason == "length" and len(r.token_ids) == 12


@pytest.mark.slow
def test_gpu_correctness_script_passes_on_cpu():
    """benchmarks/gpu_correctness.py (the first step of gpu_check.sh) at a tiny shape: the
    engine with chunked prefill, preemption and the prefix cache, and JSON requests on both
    backends, equal HF greedy token for token on weights with real logit gaps (fp32)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import gpu_correctness

    assert (
        gpu_correctness.main(["--config", "tiny-llama", "--device", "cpu", "--num-requests", "6", "--output-len", "12"])
        == 0
    )
