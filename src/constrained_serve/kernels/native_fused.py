"""The Llama layer's elementwise ops on CPU in one native pass each (fused_cpu.c): RMSNorm,
the rotary embedding with the K/V store, and SiLU(gate) * up; and the argmax of greedy
sampling (sampling.row_argmax), for fp32 logits.

In torch each is a chain of small ops; at decode sizes their dispatch and allocations, not
their arithmetic, cost 7-10 ms a step for SmolLM2-135M (see fused_cpu.c). The model
(models/llama.py) calls these where ``applies`` says so, and its torch code otherwise: on GPU,
for dtypes other than fp32 and bf16, for qk-norm models (Qwen3: the norm sits between the
projection and the rotary), for activations other than SiLU, and where the library cannot be
built or ``CONSTRAINED_SERVE_NATIVE_FUSED=0``. The results are torch's: bit for bit for the
rotary and the store, up to the last bit for RMSNorm and SiLU (see fused_cpu.c).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .native_build import NativeLibrary

SOURCE = Path(__file__).with_name("fused_cpu.c")
ENV_SWITCH = "CONSTRAINED_SERVE_NATIVE_FUSED"
# Strict IEEE arithmetic, as torch's ops round: no -ffast-math, no fused multiply-adds.
# -fno-math-errno lets the SiLU loop call glibc's vector expf; -fopenmp links the libgomp torch
# has loaded (one thread pool for both).
CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
MAX_DIM = 1024  # the rotary's head_dim limit (fused_cpu.c)
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    signatures = {
        "rms_norm": [ptr, i64, ptr, ptr, i64, i64, i64, f32, i32],
        "rope_store": [ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, ptr, i64, ptr, ptr, i32],
        "silu_mul": [ptr, i64, ptr, i64, i64, i64, i32],
    }
    for name, argtypes in signatures.items():
        for suffix in _SUFFIX.values():
            fn = getattr(lib, f"{name}_{suffix}")
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
    lib.argmax_rows_f32.argtypes, lib.argmax_rows_f32.restype = [ptr, i64, i64, i64, ptr, i32], ctypes.c_int


LIBRARY = NativeLibrary(SOURCE, CFLAGS, ENV_SWITCH, "CPU elementwise ops", _declare)


def applies(*tensors: torch.Tensor) -> bool:
    """Whether these tensors (on CPU, one dtype of fp32/bf16, unit stride in their last dim)
    can go through the native ops, and the library is available."""
    first = tensors[0]
    return (
        first.device.type == "cpu"
        and first.dtype in _SUFFIX
        and all(t.dtype == first.dtype and t.device.type == "cpu" and t.stride(-1) == 1 for t in tensors)
        and LIBRARY.get() is not None
    )


def _call(name: str, dtype: torch.dtype, *args) -> None:
    rc = getattr(LIBRARY.get(), f"{name}_{_SUFFIX[dtype]}")(*args, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"native {name} refused its arguments (sizes or slots out of range)")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the rows of x ([rows, dim]); bf16 as Hugging Face computes it (fused_cpu.c)."""
    assert x.dim() == 2 and weight.is_contiguous() and weight.shape == (x.shape[1],)
    out = torch.empty(x.shape, dtype=x.dtype)
    rows, dim = x.shape
    _call("rms_norm", x.dtype, x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), dim, rows, dim, eps)
    return out


def _head_major(cache: torch.Tensor) -> bool:
    """Whether a [P, ps, Hkv, D] pool is a view of contiguous [Hkv, P, ps, D] storage (kv_layout.py):
    a stride test, cheaper per layer than kv_layout.heads_view's permuted view."""
    p, ps, _, d = cache.shape
    return cache.stride() == (ps * d, d, p * ps * d, 1)


def rope_store_applies(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, head_dim: int) -> bool:
    """Whether ``rope_store`` can take this layer's step (and the library is available)."""
    return (
        head_dim <= MAX_DIM
        and head_dim % 2 == 0
        and _head_major(k_cache)
        and _head_major(v_cache)
        and applies(qkv, k_cache, v_cache)
    )


def rope_store(
    qkv: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    num_heads: int,
    num_kv_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotate q in place in ``qkv`` ([T, (Hq + 2 Hkv) * D]: q, k, v), write the rotated k and
    v into their slots of the head-major pools (``rope_store_applies`` first); returns q as a
    [T, Hq, D] view of ``qkv``. cos/sin: [T, 1, D] (RotaryEmbedding.tables_for), qkv's dtype."""
    cos, sin = cos_sin
    tokens, d = qkv.shape[0], cos.shape[-1]
    assert cos.is_contiguous() and sin.is_contiguous() and cos.shape == sin.shape == (tokens, 1, d)
    assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * d and k_cache.shape[2:] == (num_kv_heads, d)
    assert slot_mapping.dtype == torch.int64 and slot_mapping.shape == (tokens,) and slot_mapping.is_contiguous()
    _call(
        "rope_store",
        qkv.dtype,
        qkv.data_ptr(),
        qkv.stride(0),
        cos.data_ptr(),
        sin.data_ptr(),
        d,
        tokens,
        num_heads,
        num_kv_heads,
        d,
        slot_mapping.data_ptr(),
        k_cache.shape[0] * k_cache.shape[1],
        k_cache.data_ptr(),
        v_cache.data_ptr(),
    )
    return qkv[:, : num_heads * d].view(tokens, num_heads, d)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of ``gate_up`` ([rows, 2 * inter]: gate, then up)."""
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype)
    _call("silu_mul", gate_up.dtype, gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), inter, rows, inter)
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """The index of the first maximum of each row of fp32 ``x`` ([rows, n], unit stride in n),
    as ``torch.argmax(-1)`` (NaN counts as the maximum); int64."""
    rows, n = x.shape
    out = torch.empty(rows, dtype=torch.int64)
    if rows:
        _call("argmax_rows", torch.float32, x.data_ptr(), x.stride(0), rows, n, out.data_ptr())
    return out
