"""A model folder's config and tokenizer, read by transformers without its slow start.

``AutoConfig.from_pretrained`` imports the model's configuration module, and through it
(transformers 5) ``type_validators -> activations -> hub_kernels -> core_model_loading ->
torch.distributed.tensor``, plus the lazy index of every model package: 1.6-2.4 s of
imports in each process that loads a model (a CLI run, a Ray replica, a notebook kernel),
for a config of a dozen numbers. ``AutoTokenizer`` loads that config too.

So, what transformers gives, by cheaper routes:

- **Config**: the first load in a cache goes through ``AutoConfig``; its resolved fields
  (``to_dict()``: every default of the model type filled in, RoPE parameters standardized)
  are kept under the cache dir, keyed by the config.json bytes and the transformers
  version. Later loads build a plain ``PreTrainedConfig`` from them (1 ms): the same
  attributes, hence the same architecture and RoPE tables (tests/models/test_hf_files.py).
- **Tokenizer**: where ``AutoTokenizer`` itself ends at ``TokenizersBackend`` (the folder's
  tokenizer_config.json names that class, tokenizer.json is there, no custom code, and the
  model type is not one AutoTokenizer overrides), that class is loaded directly. Anything
  else goes through ``AutoTokenizer`` as before.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# tokenizer_config.json class names that AutoTokenizer resolves to TokenizersBackend itself.
_BACKEND_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# Model types whose AutoTokenizer path ends at the class the folder names: Qwen2 is in
# transformers' MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS (its own class wins), Mistral
# may load MistralCommonBackend; both keep the AutoTokenizer route.
_DIRECT_TOKENIZER_TYPES = ("llama", "qwen3")
_CACHE_VERSION = 1  # bump when what is stored changes


def load_config(folder: Path, cache: Path) -> PretrainedConfig:
    """The folder's config as ``AutoConfig`` resolves it; from ``cache`` when it has it."""
    kept = _cache_file(cache, (folder / "config.json").read_bytes())
    try:
        fields = json.loads(kept.read_text())
    except (OSError, ValueError):
        fields = None
    if isinstance(fields, dict) and fields.get("model_type"):
        from transformers.configuration_utils import PreTrainedConfig

        return PreTrainedConfig(**fields)
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(folder))
    _write_atomically(kept, json.dumps(cfg.to_dict()))
    return cfg


def load_tokenizer(folder: Path, config: Any) -> PreTrainedTokenizerBase:
    """The folder's tokenizer, as ``AutoTokenizer.from_pretrained(folder)`` loads it."""
    if _direct_backend(folder, getattr(config, "model_type", None)):
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(folder))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def _direct_backend(folder: Path, model_type: str | None) -> bool:
    if model_type not in _DIRECT_TOKENIZER_TYPES or not (folder / "tokenizer.json").is_file():
        return False
    try:
        tcfg = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(tcfg, dict) and tcfg.get("tokenizer_class") in _BACKEND_CLASSES and "auto_map" not in tcfg


def _cache_file(cache: Path, raw_config: bytes) -> Path:
    import transformers

    key = hashlib.sha256(raw_config + f"|{transformers.__version__}|{_CACHE_VERSION}".encode()).hexdigest()[:32]
    return cache / "configs" / f"{key}.json"


def _write_atomically(path: Path, text: str) -> None:
    """Best effort: a read-only or full cache dir only costs the next load its speed."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        logger.debug("config cache not written (%s): %s", path, e)
