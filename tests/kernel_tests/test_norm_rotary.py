"""RMSNorm(+residual) and rotary: references vs the model's formulas, Triton vs references."""
from __future__ import annotations

import pytest
import torch

from constrained_serve.kernels import norm

from .helpers import require_triton


def _tables(max_pos: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    f = torch.outer(torch.arange(max_pos, dtype=torch.float), inv)
    emb = torch.cat((f, f), dim=-1)
    return emb.cos(), emb.sin()


def test_rms_norm_reference_formula():
    g = torch.Generator().manual_seed(0)
    x, r, w = torch.randn(5, 48, generator=g), torch.randn(5, 48, generator=g), torch.randn(48, generator=g)
    out, res = norm.rms_norm_torch(x, w, 1e-6, r)
    s = (x + r).double()
    want = w.double() * s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(res, x + r)
    assert norm.rms_norm_torch(x, w, 1e-6)[1] is None


def test_rotary_reference_is_complex_rotation():
    g = torch.Generator().manual_seed(1)
    cos, sin = _tables(32, 16)
    q, k = torch.randn(4, 3, 16, generator=g), torch.randn(4, 1, 16, generator=g)
    pos = torch.tensor([0, 5, 17, 31])
    rq, _ = norm.rotary_torch(pos, q, k, cos, sin)
    zq = torch.complex(q[..., :8].double(), q[..., 8:].double())
    ang = pos.double()[:, None] * (1.0 / 10000.0 ** (torch.arange(0, 16, 2).double() / 16))
    zr = zq * torch.polar(torch.ones_like(ang), ang)[:, None, :]
    torch.testing.assert_close(rq.double(), torch.cat((zr.real, zr.imag), -1), atol=1e-5, rtol=1e-5)


# The interpreter rounds fp32 -> bf16 by truncation (the GPU rounds to nearest): allow an ulp.
_TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_triton_matches_reference(dtype, with_residual):
    require_triton()
    g = torch.Generator().manual_seed(2)
    H = 96  # not a power of two: masked tail
    x = torch.randn(7, H, generator=g).to(dtype)
    r = torch.randn(7, H, generator=g).to(dtype) if with_residual else None
    w = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)
    ref, ref_res = norm.rms_norm_torch(x, w, 1e-5, r)
    out, res = norm.rms_norm_triton(x, w, 1e-5, r)
    tol = _TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol * 4, rtol=tol)
    if with_residual:
        torch.testing.assert_close(res.float(), ref_res.float(), atol=tol * 4, rtol=tol)
    else:
        assert res is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rotary_triton_matches_reference_on_qkv_views(dtype):
    require_triton()
    g = torch.Generator().manual_seed(3)
    T, hq, hkv, d = 6, 4, 2, 64
    cos, sin = _tables(64, d)
    qkv = torch.randn(T, (hq + 2 * hkv) * d, generator=g).to(dtype)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k = q.view(T, hq, d), k.view(T, hkv, d)  # strided views, as in the model
    pos = torch.tensor([0, 1, 2, 40, 41, 63])
    rq, rk = norm.rotary_torch(pos, q, k, cos, sin)
    tq, tk = norm.rotary_triton(pos, q, k, cos, sin)
    tol = _TOL[dtype] * 2  # the reference rounds after each product
    torch.testing.assert_close(tq.float(), rq.float(), atol=tol * 4, rtol=tol)
    torch.testing.assert_close(tk.float(), rk.float(), atol=tol * 4, rtol=tol)
