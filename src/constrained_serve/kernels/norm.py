"""RMSNorm (optionally fused with the residual add) and rotary embedding, torch + Triton.

Both follow the model code's numerics (models/llama.py, as HF Llama): RMSNorm normalizes in
fp32, casts back to the input dtype, then multiplies by the weight in that dtype; with a
residual, the sum ``x + residual`` (input dtype) is both normalized and returned as the new
residual. Rotary uses the rotate-half convention with cos/sin tables [max_pos, D] (fp32).
The Triton rotary computes in fp32 and rounds once, so in bf16 it can differ from the
reference (which rounds after each product) by an ulp.
"""
from __future__ import annotations

import torch

from ._triton import HAS_TRITON, tl, triton  # noqa: F401


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [T, H] -> (normed [T, H], new residual or None)."""
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype), residual


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_torch(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D], positions int64 [T], cos/sin [max_pos, D] -> rotated (q, k)."""
    c = cos[positions].unsqueeze(1).to(q.dtype)
    s = sin[positions].unsqueeze(1).to(q.dtype)
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


if HAS_TRITON:

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, H, eps,
                         stride_x, stride_r, stride_o, stride_ro,
                         HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_H)
        m = offs < H
        x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_r + offs, mask=m, other=0.0)
            # The sum is rounded to the input dtype first, as the unfused model does.
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(res_out_ptr + row * stride_ro + offs, x, mask=m)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / H + eps)
        y = (xf * rstd).to(x.dtype).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + offs, (y * w).to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _rotary_kernel(x_ptr, out_ptr, pos_ptr, cos_ptr, sin_ptr, stride_xt, stride_xh,
                       stride_ot, stride_oh, stride_c, NUM_HEADS: tl.constexpr,
                       HALF: tl.constexpr, BLOCK_H: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, HALF)
        hm = (offs_h < NUM_HEADS)[:, None]
        c = tl.load(cos_ptr + pos * stride_c + offs_d).to(tl.float32)[None, :]
        s = tl.load(sin_ptr + pos * stride_c + offs_d).to(tl.float32)[None, :]
        base = x_ptr + t * stride_xt + offs_h[:, None] * stride_xh
        x1 = tl.load(base + offs_d[None, :], mask=hm, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF + offs_d[None, :], mask=hm, other=0.0).to(tl.float32)
        obase = out_ptr + t * stride_ot + offs_h[:, None] * stride_oh
        dt = out_ptr.dtype.element_ty
        tl.store(obase + offs_d[None, :], (x1 * c - x2 * s).to(dt), mask=hm)
        tl.store(obase + HALF + offs_d[None, :], (x2 * c + x1 * s).to(dt), mask=hm)


def _require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed: use the torch reference kernels "
                           "(CONSTRAINED_SERVE_KERNELS=torch) or `pip install triton`")


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton version of :func:`rms_norm_torch` (one program per row, whole row in registers)."""
    _require_triton()
    T, H = x.shape
    assert x.stride(-1) == 1 and weight.is_contiguous()
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else None
    if T == 0:
        return out, res_out
    r = residual if residual is not None else x
    ro = res_out if res_out is not None else out
    block = _next_pow2(H)
    _rms_norm_kernel[(T,)](x, r, weight, out, ro, H, float(eps), x.stride(0), r.stride(0),
                           out.stride(0), ro.stride(0), HAS_RESIDUAL=residual is not None,
                           BLOCK_H=block, num_warps=4 if block <= 2048 else 8)
    return out, res_out


def _rotary_one(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
    T, nh, d = x.shape
    out = torch.empty(T, nh, d, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    assert x.stride(-1) == 1 and cos.stride(-1) == 1 and d % 2 == 0 and (d // 2) & (d // 2 - 1) == 0
    _rotary_kernel[(T,)](x, out, positions, cos, sin, x.stride(0), x.stride(1), out.stride(0),
                         out.stride(1), cos.stride(0), NUM_HEADS=nh, HALF=d // 2,
                         BLOCK_H=_next_pow2(nh))
    return out


def rotary_triton(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`rotary_torch`; q/k may be strided views (e.g. of a fused qkv)."""
    _require_triton()
    assert cos.shape == sin.shape and cos.stride() == sin.stride()
    return _rotary_one(q, positions, cos, sin), _rotary_one(k, positions, cos, sin)
