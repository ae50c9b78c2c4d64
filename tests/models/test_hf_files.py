"""A model folder's config and tokenizer by the fast routes (models/hf_files.py) equal what
transformers' AutoConfig and AutoTokenizer give, and a warm start skips their slow imports."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from constrained_serve.models import hf_files
from constrained_serve.models.llama import ModelArchitecture, RotaryEmbedding

from ..helpers import subprocess_env

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hällo <|im_end|> 12\t3."}]


@pytest.fixture(params=["tiny_llama_dir", "tiny_qwen3_dir", "default_model_dir"])
def model_dir(request):
    return request.getfixturevalue(request.param)


def test_cached_config_equals_autoconfig(model_dir, tmp_path) -> None:
    ref = AutoConfig.from_pretrained(str(model_dir))
    first = hf_files.load_config(model_dir, tmp_path)  # through AutoConfig, kept
    assert type(first) is type(ref) and len(list((tmp_path / "configs").glob("*.json"))) == 1
    second = hf_files.load_config(model_dir, tmp_path)  # from the cache
    assert type(second).__name__ == "PreTrainedConfig"
    fields = [k for k in ref.to_dict() if k != "use_cache"]
    assert {k: getattr(second, k) for k in fields} == {k: getattr(ref, k) for k in fields}
    arch = ModelArchitecture.from_hf_config(ref)
    assert ModelArchitecture.from_hf_config(second) == arch
    tables = [RotaryEmbedding._tables(c, arch.head_dim, 300) for c in (ref, second)]
    assert all(torch.equal(a, b) for a, b in zip(*tables))  # llama3 RoPE scaling (the tiny Llama) included


def test_the_cache_is_keyed_by_the_config_and_survives_damage(tiny_llama_dir, tmp_path) -> None:
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, folder)
    hf_files.load_config(folder, tmp_path / "cache")
    [kept] = (tmp_path / "cache" / "configs").glob("*.json")
    kept.write_text("{not json")  # a damaged entry: loaded the slow way and rewritten
    assert hf_files.load_config(folder, tmp_path / "cache").rms_norm_eps == 1e-5
    assert json.loads(kept.read_text())["model_type"] == "llama"
    # An edited config.json is another entry, never the old one.
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-3}))
    assert hf_files.load_config(folder, tmp_path / "cache").rms_norm_eps == 1e-3
    assert hf_files.load_config(folder, tmp_path / "cache").rms_norm_eps == 1e-3
    assert len(list((tmp_path / "cache" / "configs").glob("*.json"))) == 2
    # A cache that cannot be written costs speed only.
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache dir would be")
    assert hf_files.load_config(folder, blocked).rms_norm_eps == 1e-3


def test_tokenizer_equals_autotokenizer(model_dir) -> None:
    cfg = AutoConfig.from_pretrained(str(model_dir))
    fast, ref = hf_files.load_tokenizer(model_dir, cfg), AutoTokenizer.from_pretrained(str(model_dir))
    assert type(fast) is type(ref) and fast.get_vocab() == ref.get_vocab()
    assert fast.all_special_ids == ref.all_special_ids
    assert str(fast.added_tokens_decoder) == str(ref.added_tokens_decoder)
    text = "Hällo <|im_start|> wörld 123"
    assert fast.encode(text) == ref.encode(text)
    assert fast.apply_chat_template(MESSAGES, add_generation_prompt=True) == ref.apply_chat_template(
        MESSAGES, add_generation_prompt=True
    )
    assert fast.decode(list(range(0, 5000, 97))) == ref.decode(list(range(0, 5000, 97)))


def test_only_folders_autotokenizer_would_load_as_the_backend_take_the_short_route(tiny_llama_dir, tmp_path) -> None:
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, folder)
    assert hf_files._direct_backend(folder, "llama")
    assert not hf_files._direct_backend(folder, "qwen2")  # AutoTokenizer overrides Qwen2's class
    assert not hf_files._direct_backend(folder, "mistral")
    tcfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**tcfg, "tokenizer_class": "GPT2Tokenizer"}))
    assert not hf_files._direct_backend(folder, "llama")
    (folder / "tokenizer_config.json").write_text(json.dumps({**tcfg, "auto_map": {"AutoTokenizer": ["x.Y", None]}}))
    assert not hf_files._direct_backend(folder, "llama")


def test_a_warm_start_skips_the_slow_transformers_imports(tiny_llama_dir, tmp_path) -> None:
    """In a fresh process with the config cached, neither the model type's configuration module
    nor torch.distributed.tensor (1.6-2.4 s of imports) is loaded."""
    hf_files.load_config(tiny_llama_dir, tmp_path)
    code = (
        "import sys; from constrained_serve.models import loader\n"
        f"cfg, tok = loader.load_config_and_tokenizer(loader.resolve_model({str(tiny_llama_dir)!r}))\n"
        "mods = ('torch.distributed.tensor', 'transformers.models.llama.configuration_llama')\n"
        "slow = [m for m in mods if m in sys.modules]\n"
        "print(type(cfg).__name__, type(tok).__name__, slow)\n"
    )
    env = {**subprocess_env(), "CONSTRAINED_SERVE_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["PreTrainedConfig", "TokenizersBackend", "[]"], done.stdout
