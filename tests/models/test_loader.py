"""Loading a model (loader.py): a folder or a .gguf file, missing paths refused, dummy weights
deterministic, CPU linears packed unless turned off, checkpoints the model would misread
refused, stray config keys and Mistral's consolidated files ignored as HF ignores them."""

import pytest
import torch

from constrained_serve import Engine
from constrained_serve.kernels import onednn
from constrained_serve.models import loader
from constrained_serve.models.cpu_linear import PackedLinear

from .helpers import PROMPTS, hf_logits, our_logits, save_random, small_config


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


def test_fp32_on_cpu_is_packed_unless_turned_off(tiny_llama_dir, default_tokenizer, monkeypatch):
    src = loader.resolve_model(str(tiny_llama_dir))
    cfg, _ = loader.load_config_and_tokenizer(src)

    def packed(dtype):
        m = loader.build_model(src, cfg, dtype, torch.device("cpu"))
        return sum(isinstance(x, PackedLinear) for x in m.modules())

    n_layers = cfg.num_hidden_layers
    assert packed(torch.float32) == 4 * n_layers + 1  # qkv, o, gate_up, down; the LM head
    # bf16 only where oneDNN runs it (not on an AVX2-only CPU: kernels/onednn.supports)
    assert packed(torch.bfloat16) == (4 * n_layers + 1 if onednn.supports(torch.bfloat16) else 0)
    assert packed(torch.float16) == 0
    _, prefill_packed, decode_packed = our_logits(tiny_llama_dir, default_tokenizer, PROMPTS[:2])
    monkeypatch.setenv("CONSTRAINED_SERVE_CPU_LINEAR", "torch")
    assert packed(torch.float32) == 0
    _, prefill_dense, decode_dense = our_logits(tiny_llama_dir, default_tokenizer, PROMPTS[:2])
    for a, b in zip([*prefill_packed, *decode_packed], [*prefill_dense, *decode_dense]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


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

    cfg = small_config(Qwen2Config, default_tokenizer)
    cfg.attention_bias = True  # a stray key in config.json
    folder = save_random(tmp_path, cfg, default_tokenizer)
    save_file({"layers.0.attention.wq.weight": torch.zeros(64, 64)}, str(folder / "consolidated.safetensors"))
    reqs, prefill, _ = our_logits(folder, default_tokenizer, PROMPTS[:1])
    assert (prefill[0] - hf_logits(folder, reqs[0].token_ids)[-2]).abs().max().item() < 1e-4


def test_materialize_gives_meta_models_cpu_storage_in_the_dtype_and_keeps_ties():
    """build_model's replacement of Module.to_empty(...).to(dtype) (see loader.materialize)."""
    nn = torch.nn
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=True))
        model[1].weight = model[0].weight  # tied, as tie_word_embeddings would tie them
        model.register_buffer("steps", torch.zeros(3, dtype=torch.int64), persistent=False)
        model.register_buffer("scale", torch.ones(2))
    loader.materialize(model, torch.bfloat16)
    tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    assert all(t.device.type == "cpu" for t in tensors.values())
    assert model[0].weight is model[1].weight and isinstance(model[0].weight, nn.Parameter)
    assert model[1].bias.dtype == torch.bfloat16 and model[1].bias.requires_grad
    assert model.steps.dtype == torch.int64 and model.scale.dtype == torch.bfloat16
    assert set(model.state_dict()) == {"0.weight", "1.weight", "1.bias", "scale"}  # persistence kept
