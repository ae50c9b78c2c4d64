"""Engine arguments (config.py): a bad one is refused with its name; the CPU thread count."""

import os

import pytest


def test_bad_engine_args_name_the_argument(tiny_llama_dir, monkeypatch):
    from constrained_serve import Engine
    from constrained_serve.config import EngineConfig

    with pytest.raises(ValueError, match="max_model_len"):
        Engine(model=str(tiny_llama_dir), max_model_len=0)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert EngineConfig().cpu_threads() == 1 and EngineConfig(num_threads=3).cpu_threads() == 3
    # Unset (the suite sets it: tests/conftest.py), all cores.
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert EngineConfig().cpu_threads() == (os.cpu_count() or 1)
    with pytest.raises(ValueError, match="device"):
        Engine(model=str(tiny_llama_dir), device="tpu")
    with pytest.raises(ValueError, match="model"):
        Engine(model="/nonexistent/model/dir")
