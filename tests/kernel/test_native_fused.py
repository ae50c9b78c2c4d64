"""The native CPU elementwise ops (kernels/fused_cpu.c via native_fused.py) against the torch
code they replace in models/llama.py, in fp32 and bf16; the model takes them on CPU; and the
build of the native libraries (native_build.py) is cached per source, flags and CPU."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from constrained_serve.kernels import attention, kv_layout, native_build, native_decode, native_fused
from constrained_serve.models.llama import RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16]

# The OpenMP loops of the native code on two threads (the suite's default is one).
pytestmark = pytest.mark.usefixtures("two_threads")


@pytest.fixture(autouse=True)
def _library():
    assert native_fused.LIBRARY.get() is not None, "the native ops did not build: they need a C compiler (cc, gcc)"


def _hf_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm (bf16), F.rms_norm (fp32): the model's torch code."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _assert_close_to_torch(out: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32: within a few float ulps. bf16: at most one bf16 ulp apart, and rarely: the
    sum of squares and exp round differently from torch's in the last fp32 bit, which moves
    a bf16 result only when it lies next to a rounding boundary."""
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=4e-6, atol=1e-6)
        return
    diff = (out.float() - ref.float()).abs()
    ulp = ref.float().abs() * 2.0**-7 + 1e-30
    assert bool((diff <= ulp).all()), f"off by more than one bf16 ulp: {float((diff / ulp).max()):.2f}"
    assert (out != ref).float().mean().item() <= 0.002, "too many results differ from torch's"


@pytest.mark.parametrize("rows,dim", [(1, 576), (64, 576), (300, 577), (5, 7)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_the_models_torch_code(rows, dim, dtype):
    g = torch.Generator().manual_seed(rows * dim)
    x = (torch.randn(rows, dim, generator=g) * 3).to(dtype)
    w = (torch.randn(dim, generator=g) + 1).to(dtype)
    _assert_close_to_torch(native_fused.rms_norm(x, w, 1e-5), _hf_rms_norm(x, w, 1e-5))
    strided = torch.randn(rows, dim + 9, generator=g).to(dtype)[:, 3 : 3 + dim]  # rows apart in memory
    _assert_close_to_torch(native_fused.rms_norm(strided, w, 1e-6), _hf_rms_norm(strided, w, 1e-6))


@pytest.mark.parametrize("rows,inter", [(1, 1536), (64, 1536), (200, 1000), (3, 5)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(rows, inter, dtype):
    g = torch.Generator().manual_seed(rows + inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype)
    gate, up = gate_up.split(inter, dim=-1)
    _assert_close_to_torch(native_fused.silu_mul(gate_up), F.silu(gate) * up)


def test_argmax_rows_is_torch_argmax(monkeypatch):
    """The first maximum of each row, NaN counted as the maximum, at block edges and past
    them, over rows apart in memory; and row_argmax (greedy sampling) takes it for fp32."""
    import math

    from constrained_serve.kernels import sampling

    g = torch.Generator().manual_seed(7)
    wide = torch.randn(64, 49152 + 17, generator=g)
    x = wide[:, :49152]  # rows 49169 elements apart
    x[0, -1] = 9.0  # the last element
    x[1, 63:65] = 9.0  # a tie across a block edge: the first wins
    x[2] = -math.inf
    x[3, [5, 700]] = math.nan
    x[4, 0] = math.nan
    x[5] = 1.0  # all equal
    assert torch.equal(native_fused.argmax_rows(x), x.argmax(-1))
    small = torch.randint(-3, 3, (9, 67), generator=g).float()  # ties everywhere, n past one block
    assert torch.equal(native_fused.argmax_rows(small), small.argmax(-1))
    assert native_fused.argmax_rows(torch.zeros(0, 5)).shape == (0,)
    calls = []
    real = native_fused.argmax_rows
    monkeypatch.setattr(native_fused, "argmax_rows", lambda t: calls.append(1) or real(t))
    assert torch.equal(sampling.row_argmax(x), x.argmax(-1)) and calls


def _rope_case(tokens, hq, hkv, d, dtype, seed):
    """A step's qkv, its rotary tables (real ones, with llama3 scaling), and a head-major pool
    with its slots scattered, as the engine has them."""
    from transformers import LlamaConfig

    g = torch.Generator().manual_seed(seed)
    config = LlamaConfig(
        head_dim=d,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    rotary = RotaryEmbedding(config, d, 4096)
    positions = torch.randint(0, 4096, (tokens,), generator=g)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=g).to(dtype)
    pools = [kv_layout.allocate_pool(40, 16, hkv, d, dtype, torch.device("cpu"), head_major=True) for _ in range(2)]
    slots = torch.randperm(40 * 16, generator=g)[:tokens]
    return qkv, rotary.tables_for(positions, dtype), pools, slots


def _torch_rope_store(qkv, cos_sin, hq, hkv, d, pools, slots):
    """The model's torch code: split, rotate q and k, store k and v."""
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    t = qkv.shape[0]
    q, k = RotaryEmbedding.apply(cos_sin, q.reshape(t, hq, d), k.reshape(t, hkv, d))
    attention.store_kv_torch(k, v.reshape(t, hkv, d), pools[0], pools[1], slots)
    return q


@pytest.mark.parametrize("tokens,hq,hkv,d", [(1, 9, 3, 64), (64, 9, 3, 64), (300, 8, 2, 128), (7, 4, 4, 32)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_is_the_torch_rotary_and_store_bit_for_bit(tokens, hq, hkv, d, dtype):
    qkv, cos_sin, pools, slots = _rope_case(tokens, hq, hkv, d, dtype, seed=tokens + d)
    ref_q = _torch_rope_store(qkv.clone(), cos_sin, hq, hkv, d, pools, slots)
    mine = [torch.zeros_like(p) for p in pools]  # same strides: zeros_like keeps the permuted layout
    assert native_fused.rope_store_applies(qkv, *mine, d)
    q = native_fused.rope_store(qkv, cos_sin, hq, hkv, mine[0], mine[1], slots)
    assert q.data_ptr() == qkv.data_ptr(), "q is rotated in place"
    assert torch.equal(q, ref_q)
    assert torch.equal(mine[0], pools[0]) and torch.equal(mine[1], pools[1])


def test_rope_store_refuses_a_slot_outside_the_pool_and_writes_nothing():
    qkv, cos_sin, pools, slots = _rope_case(8, 2, 1, 16, torch.float32, seed=1)
    before = qkv.clone()
    for bad in (40 * 16, -1):
        slots[5] = bad
        with pytest.raises(RuntimeError, match="out of range"):
            native_fused.rope_store(qkv, cos_sin, 2, 1, pools[0], pools[1], slots)
        assert torch.equal(qkv, before) and not pools[0].any() and not pools[1].any()


def test_rope_store_takes_head_major_pools_only():
    qkv, _, _, _ = _rope_case(4, 2, 1, 16, torch.float32, seed=2)
    contiguous = kv_layout.allocate_pool(40, 16, 1, 16, torch.float32, torch.device("cpu"), head_major=False)
    assert not native_fused.rope_store_applies(qkv, contiguous, contiguous, 16)
    assert not native_fused.rope_store_applies(qkv.to(torch.float16), contiguous, contiguous, 16)


def _logits(folder, tok):
    from tests.models.helpers import PROMPTS, our_logits

    _, prefill, decode = our_logits(folder, tok, PROMPTS)  # chunked prefill, then a decode step
    return torch.stack(prefill), decode


def test_the_model_takes_the_native_ops_on_cpu(tiny_llama_dir, default_tokenizer, monkeypatch):
    """Every layer of every forward calls each native op (the norms twice, plus the final
    norm), and the logits are those of the model's torch code (switched off) up to rounding."""
    calls = {"rms_norm": 0, "rope_store": 0, "silu_mul": 0}
    for name in calls:
        real = getattr(native_fused, name)

        def counting(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)

        monkeypatch.setattr(native_fused, name, counting)
    fused = _logits(tiny_llama_dir, default_tokenizer)
    layers = 2  # tests/models/helpers.small_config
    assert calls["rope_store"] > 0 and calls["rope_store"] == calls["silu_mul"]
    assert calls["rms_norm"] * layers == (2 * layers + 1) * calls["rope_store"]
    monkeypatch.setattr(native_fused, "applies", lambda *t: False)
    monkeypatch.setattr(native_fused, "rope_store_applies", lambda *a: False)
    for mine, theirs in zip(fused, _logits(tiny_llama_dir, default_tokenizer)):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("how", ["no compiler", "switched off"])
def test_without_the_library_the_model_runs_its_torch_code(how, tiny_llama_dir, default_tokenizer, monkeypatch, caplog):
    expected = _logits(tiny_llama_dir, default_tokenizer)
    native_fused.LIBRARY.reset()
    if how == "no compiler":
        monkeypatch.setenv("CC", "/nonexistent/cc")
    else:
        monkeypatch.setenv(native_fused.ENV_SWITCH, "0")
    try:
        with caplog.at_level(logging.INFO, logger=native_build.__name__):
            assert not native_fused.applies(torch.zeros(2, 2))
            for mine, theirs in zip(_logits(tiny_llama_dir, default_tokenizer), expected):
                torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
        assert ("failed" if how == "no compiler" else "off") in caplog.text
    finally:
        native_fused.LIBRARY.reset()


@pytest.mark.parametrize("library", [native_decode.LIBRARY, native_fused.LIBRARY], ids=["decode", "fused"])
def test_the_build_is_cached_per_source_flags_and_cpu(library, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cc = native_build.compiler()
    assert cc is not None, "no C compiler: install gcc (the native CPU kernels are built with it)"
    first = native_build.build(cc, library.source, library.cflags)
    assert first.parent == tmp_path / "constrained_serve" / "native" and first.exists()
    assert first.name.startswith(library.source.stem)
    stamp = first.stat().st_mtime_ns
    assert native_build.build(cc, library.source, library.cflags) == first
    assert first.stat().st_mtime_ns == stamp  # not rebuilt
    # Other flags, another CPU, another source: each its own build. A one-line source stands
    # in for the library's (the key hashes whatever the source is; its compile takes ~7 s).
    small = tmp_path / library.source.name
    small.write_text("int constrained_serve_probe(void) { return 1; }\n")
    base = native_build.build(cc, small, library.cflags)
    second = native_build.build(cc, small, [*library.cflags, "-DDIFFERENT"])
    assert len({first, base, second}) == 3
    monkeypatch.setattr(native_build, "cpu_identity", lambda: "model name : another CPU")
    assert native_build.build(cc, small, library.cflags) not in (base, second)  # -march=native
