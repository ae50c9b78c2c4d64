"""The dispatcher's choices (Triton or the torch reference, and without Triton at all), and,
since the interpreter never runs the real compiler, every kernel it dispatches to lowered for
sm_90 through the Triton frontend (no GPU needed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from constrained_serve.kernels import attention, dispatch, sampling
from constrained_serve.kernels.sampling_tensors import SamplingTensors

from .helpers import make_batch, require_triton

ROOT = Path(__file__).resolve().parents[2]


def test_kernels_pass_the_gpu_compiler_frontend():
    require_triton()
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compile_check.py"), "--frontend-only", "--arch", "90"],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dispatch_choices(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("CONSTRAINED_SERVE_KERNELS", "auto")
    assert not dispatch.use_triton(cpu)
    assert dispatch.use_triton(torch.device("cuda")) == attention.HAS_TRITON
    monkeypatch.setenv("CONSTRAINED_SERVE_KERNELS", "torch")
    assert not dispatch.use_triton(torch.device("cuda"))
    monkeypatch.setenv("CONSTRAINED_SERVE_KERNELS", "bogus")
    with pytest.raises(ValueError):
        dispatch.use_triton(cpu)


def test_dispatch_forced_triton_runs_under_interpreter(monkeypatch):
    require_triton()
    monkeypatch.setenv("CONSTRAINED_SERVE_KERNELS", "triton")
    g = torch.Generator().manual_seed(0)
    meta = make_batch([1, 3], [5, 3], 16, 4, g)
    kc, vc = torch.randn(4, 16, 1, 64, generator=g), torch.randn(4, 16, 1, 64, generator=g)
    k, v = torch.randn(4, 1, 64, generator=g), torch.randn(4, 1, 64, generator=g)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    dispatch.store_kv(k, v, kc, vc, meta.slot_mapping)
    attention.store_kv_torch(k, v, kc_ref, vc_ref, meta.slot_mapping)
    assert torch.equal(kc, kc_ref)
    q = torch.randn(4, 2, 64, generator=g)
    torch.testing.assert_close(
        dispatch.paged_attention(q, kc, vc, meta, 0.125), attention.paged_attention_torch(q, kc, vc, meta, 0.125)
    )
    logits = torch.randn(3, 40, generator=g)
    greedy = SamplingTensors.full(3)
    tokens = dispatch.sample(logits, None, greedy)
    assert torch.equal(tokens, logits.argmax(-1))
    bitmask = torch.full((3, 2), -1, dtype=torch.int32)
    bitmask[0] = torch.tensor([1, 0], dtype=torch.int32)  # row 0 allows token 0 only
    masked = dispatch.sample(logits.clone(), bitmask, greedy)
    assert masked[0] == 0
    assert torch.equal(masked, sampling.sample_torch(logits.clone(), bitmask, greedy))


def test_package_works_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
        "import torch\n"
        "from constrained_serve.kernels import attention, dispatch, sampling\n"
        "assert not attention.HAS_TRITON and not sampling.HAS_TRITON\n"
        "assert not dispatch.use_triton(torch.device('cuda'))\n"
        "from constrained_serve.kernels.sampling_tensors import SamplingTensors\n"
        "t = dispatch.sample(torch.tensor([[0., 1.], [2., 0.]]), None, SamplingTensors.full(2))\n"
        "assert t.tolist() == [1, 0]\n"
        "try:\n"
        "    sampling.sample_triton(torch.zeros(1, 2), None, SamplingTensors.full(1))\n"
        "except RuntimeError as e:\n"
        "    assert 'triton is not installed' in str(e)\n"
        "else:\n"
        "    raise AssertionError('expected RuntimeError')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dispatch_falls_back_for_unsupported_head_dim(monkeypatch):
    monkeypatch.setenv("CONSTRAINED_SERVE_KERNELS", "triton")
    g = torch.Generator().manual_seed(1)
    meta = make_batch([1, 2], [3, 2], 16, 2, g)
    q = torch.randn(3, 2, 24, generator=g)  # head_dim 24: not a power of two
    kc, vc = torch.randn(2, 16, 1, 24, generator=g), torch.randn(2, 16, 1, 24, generator=g)
    assert not attention.triton_supports(q, kc)
    torch.testing.assert_close(
        dispatch.paged_attention(q, kc, vc, meta, 0.2), attention.paged_attention_torch(q, kc, vc, meta, 0.2)
    )
