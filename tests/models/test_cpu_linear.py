"""Prepacked CPU linears (cpu_linear.py) equal torch's dense linear, in fp32 and bf16."""

import pytest
import torch

from constrained_serve.kernels import onednn
from constrained_serve.models.cpu_linear import PackedLinear, should_pack


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_dense(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 48, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(rows, 48, generator=g)
    lin = PackedLinear(w, b)
    torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin(x[:, :48].t().contiguous().t()), lin(x))  # strided input
    assert torch.equal(lin.weight, w)


def test_packed_linear_bf16_matches_dense():
    if not onednn.supports(torch.bfloat16):
        # An AVX2-only CPU (oneDNN cannot pack bf16 there): the loader must not ask it to,
        # so a bf16 model's linears stay torch's (before, Engine(dtype="bfloat16") raised here).
        assert not should_pack(torch.device("cpu"), torch.bfloat16)
        return
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(96, 48, generator=g).bfloat16(), torch.randn(96, generator=g).bfloat16()
    x = torch.randn(20, 48, generator=g).bfloat16()
    y = PackedLinear(w, b)(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(
        y.float(), torch.nn.functional.linear(x.float(), w.float(), b.float()), rtol=2e-2, atol=5e-2
    )
