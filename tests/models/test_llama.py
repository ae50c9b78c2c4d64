"""Our forward equals HF transformers' for the same weights (fp32)."""

import pytest
import torch

from constrained_serve import Engine
from constrained_serve.batch import Batch, ScheduledChunk
from constrained_serve.kernels import long_chunks
from constrained_serve.models import loader
from constrained_serve.models.cpu_linear import PackedLinear
from constrained_serve.params import SamplingParams
from constrained_serve.request import Request
from constrained_serve.runner import ModelRunner

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:",
    "Once upon a time, in a land far away, there lived",
]


def _our_logits(folder, tok, prompts, chunk=5, pages_per_request=4):
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


def _hf_logits(folder, ids, gguf=None):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("which", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_tiny_logits_match_hf(which, request, default_tokenizer):
    folder = request.getfixturevalue(which)
    reqs, prefill, decode = _our_logits(folder, default_tokenizer, PROMPTS)
    for r, pre, dec in zip(reqs, prefill, decode):
        ref = _hf_logits(folder, r.token_ids)
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
    reqs, prefill, decode = _our_logits(tiny_llama_dir, default_tokenizer, prompts, chunk=200, pages_per_request=40)
    assert calls, "the per-head path did not run"
    assert min(r.num_prompt for r in reqs) > 300
    for r, pre, dec in zip(reqs, prefill, decode):
        ref = _hf_logits(tiny_llama_dir, r.token_ids)
        assert (pre - ref[-2]).abs().max().item() < 1e-4
        assert (dec - ref[-1]).abs().max().item() < 1e-4


@pytest.mark.slow
def test_default_model_logits_match_hf_gguf(default_model_dir, default_tokenizer):
    """Against HF's own GGUF loader (independent dequantization and q/k un-permutation)."""
    from transformers import AutoModelForCausalLM

    gguf = loader.default_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    reqs, prefill, decode = _our_logits(default_model_dir, default_tokenizer, PROMPTS)
    for r, pre, dec in zip(reqs, prefill, decode):
        with torch.no_grad():
            ref = hf(torch.tensor([r.token_ids])).logits[0]
        assert (pre - ref[-2]).abs().max().item() < 1e-3
        assert (dec - ref[-1]).abs().max().item() < 1e-3
        assert int(pre.argmax()) == int(ref[-2].argmax())
        assert int(dec.argmax()) == int(ref[-1].argmax())


def test_gguf_file_loads_directly():
    """A .gguf path is accepted as the model (dequantized on load)."""
    src = loader.resolve_model(str(loader.default_gguf_path()))
    assert src.gguf is not None


def test_missing_model_path_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="model"):
        loader.resolve_model(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="config.json"):
        loader.resolve_model(str(tmp_path))


def test_dummy_load_format_is_deterministic(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("CONSTRAINED_SERVE_CPU_LINEAR", "torch")  # keep the weights as parameters
    src = loader.resolve_model(str(tiny_llama_dir))
    cfg, _ = loader.load_config_and_tokenizer(src)
    a = loader.build_model(src, cfg, torch.float32, torch.device("cpu"), "dummy")
    b = loader.build_model(src, cfg, torch.float32, torch.device("cpu"), "dummy")
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_dense(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 48, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(rows, 48, generator=g)
    lin = PackedLinear(w, b)
    torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin(x[:, :48].t().contiguous().t()), lin(x))  # strided input
    assert torch.equal(lin.weight, w)


def test_packed_linear_bf16_matches_dense():
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(96, 48, generator=g).bfloat16(), torch.randn(96, generator=g).bfloat16()
    x = torch.randn(20, 48, generator=g).bfloat16()
    y = PackedLinear(w, b)(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(
        y.float(), torch.nn.functional.linear(x.float(), w.float(), b.float()), rtol=2e-2, atol=5e-2
    )


def test_fp32_on_cpu_is_packed_unless_turned_off(tiny_llama_dir, default_tokenizer, monkeypatch):
    src = loader.resolve_model(str(tiny_llama_dir))
    cfg, _ = loader.load_config_and_tokenizer(src)

    def packed(dtype):
        m = loader.build_model(src, cfg, dtype, torch.device("cpu"))
        return sum(isinstance(x, PackedLinear) for x in m.modules())

    n_layers = cfg.num_hidden_layers
    assert packed(torch.float32) == 4 * n_layers + 1  # qkv, o, gate_up, down; the LM head
    assert packed(torch.bfloat16) == 4 * n_layers + 1
    assert packed(torch.float16) == 0
    _, prefill_packed, decode_packed = _our_logits(tiny_llama_dir, default_tokenizer, PROMPTS[:2])
    monkeypatch.setenv("CONSTRAINED_SERVE_CPU_LINEAR", "torch")
    assert packed(torch.float32) == 0
    _, prefill_dense, decode_dense = _our_logits(tiny_llama_dir, default_tokenizer, PROMPTS[:2])
    for a, b in zip([*prefill_packed, *decode_packed], [*prefill_dense, *decode_dense]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _save_random(tmp_path, config, tokenizer):
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


def _small(cls, tok, **kw):
    return cls(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        **kw,
    )


@pytest.mark.parametrize("variant", ["llama_biases_gelu", "qwen2_biases", "qwen3_attention_bias"])
def test_config_variants_match_hf(variant, tmp_path, default_tokenizer):
    """o_proj and MLP biases (attention_bias, mlp_bias) and hidden_act were read from the
    config but not used: the outputs differed from HF's with no error."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    cfg = {
        "llama_biases_gelu": lambda: _small(
            LlamaConfig, default_tokenizer, attention_bias=True, mlp_bias=True, hidden_act="gelu_pytorch_tanh"
        ),
        "qwen2_biases": lambda: _small(Qwen2Config, default_tokenizer),
        "qwen3_attention_bias": lambda: _small(Qwen3Config, default_tokenizer, attention_bias=True, head_dim=32),
    }[variant]()
    folder = _save_random(tmp_path, cfg, default_tokenizer)
    reqs, prefill, decode = _our_logits(folder, default_tokenizer, PROMPTS[:2])
    for r, pre, dec in zip(reqs, prefill, decode):
        ref = _hf_logits(folder, r.token_ids)
        assert (pre - ref[-2]).abs().max().item() < 1e-4
        assert (dec - ref[-1]).abs().max().item() < 1e-4


def test_sliding_window_caps_the_context(tmp_path, default_tokenizer):
    """We attend to the whole context, which equals windowed attention up to the window."""
    from transformers import MistralConfig

    from constrained_serve import Engine

    folder = _save_random(tmp_path, _small(MistralConfig, default_tokenizer, sliding_window=32), default_tokenizer)
    eng = Engine(model=str(folder), kv_cache_tokens=256)
    assert eng.max_model_len == 32
    [r] = eng.generate([list(range(5, 25))], SamplingParams(max_tokens=50, ignore_eos=True))
    assert r.finish_reason == "length" and len(r.token_ids) == 12


def test_checkpoints_the_model_would_misread_are_refused(tmp_path, tiny_llama_dir):
    import shutil

    from safetensors.torch import load_file, save_file

    def variant(name, change):
        d = tmp_path / name
        shutil.copytree(tiny_llama_dir, d)
        [f] = d.glob("*.safetensors")
        w = load_file(str(f))
        change(w)
        save_file(w, str(f), metadata={"format": "pt"})
        return d

    extra = variant("extra", lambda w: w.update({"model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}))
    with pytest.raises(ValueError, match="does not use.*o_proj.bias"):
        Engine(model=str(extra))

    # Rows moved from gate_proj to up_proj: the fused total is right, each part is not.
    def shift(w):
        g, u = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"
        w[g], w[u] = w[g][:100].clone(), torch.cat([w[u], w[g][100:]]).clone()

    with pytest.raises(ValueError, match="gate_proj.weight has 100 rows, expected 128"):
        Engine(model=str(variant("shift", shift)))
    with pytest.raises(ValueError, match="is a file"):
        loader.resolve_model(str(tiny_llama_dir / "config.json"))


def test_stray_config_keys_and_mistral_consolidated_files_are_ignored(tmp_path, default_tokenizer):
    """As HF reads them: a Qwen2 config's attention_bias key changes nothing (Qwen2 has fixed
    biases), and a Mistral repo's consolidated.safetensors (Mistral's own tensor names, a
    copy of the HF-named weights) is not loaded next to the model-*.safetensors files."""
    from safetensors.torch import save_file
    from transformers import Qwen2Config

    cfg = _small(Qwen2Config, default_tokenizer)
    cfg.attention_bias = True  # a stray key in config.json
    folder = _save_random(tmp_path, cfg, default_tokenizer)
    save_file({"layers.0.attention.wq.weight": torch.zeros(64, 64)}, str(folder / "consolidated.safetensors"))
    reqs, prefill, _ = _our_logits(folder, default_tokenizer, PROMPTS[:1])
    assert (prefill[0] - _hf_logits(folder, reqs[0].token_ids)[-2]).abs().max().item() < 1e-4


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
