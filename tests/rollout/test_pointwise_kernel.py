"""The row-wise kernels (rollout/kernels/pointwise_kernel.py): the rotary embedding with the torch
expression's bits, RMSNorm close to torch's with a row's bits independent of the other rows."""
import pytest
import torch

from rollout.core import model
from rollout.kernels import ops, pointwise_kernel

pytestmark = pytest.mark.skipif(pointwise_kernel.load() is None, reason="no C compiler for the pointwise kernel")


def torch_rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,heads,dim", [(1, 1, 2), (7, 4, 32), (33, 2, 64), (5, 3, 128)])
def test_rotation_has_the_torch_expressions_bits(n, heads, dim, dtype):
    g = torch.Generator().manual_seed(n * heads + dim)
    x = (torch.randn(n, heads, dim, generator=g) * 10).to(dtype)
    angles = torch.rand(n, 1, dim // 2, generator=g) * 1000
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    got = pointwise_kernel.rotate(x, cos, sin)
    assert got is not None and torch.equal(got, torch_rotate(x, cos, sin))
    assert torch.equal(ops.rotate(x, cos, sin), got)


# bfloat16: the normalised row and the product each rounded once (2^-8 relative, twice)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2 ** -7)])
@pytest.mark.parametrize("dim", [8, 37, 128, 896])
def test_rms_norm_matches_torch_and_a_row_ignores_the_others(dim, dtype, tol):
    g = torch.Generator().manual_seed(dim)
    norm = model.RMSNorm(dim, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=g))
    x = (torch.randn(40, dim, generator=g) * 3).to(dtype)
    with torch.inference_mode():
        got = norm(x)
        assert got.dtype == dtype and torch.equal(got, pointwise_kernel.rms_norm(x, norm.weight, 1e-6))
        ref = norm.weight.double() * x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
        assert torch.allclose(got.double(), ref, rtol=tol, atol=tol)
        for n in (1, 2, 5, 17):
            assert torch.equal(norm(x[:n]), got[:n])
            assert torch.equal(norm(torch.cat([x[n:n + 3], x[:1]]))[-1], got[0])
        assert torch.equal(norm(x.view(8, 5, dim)), got.view(8, 5, dim))  # leading dimensions are rows


def test_other_inputs_are_left_to_torch():
    x, cos = torch.randn(3, 2, 8), torch.randn(3, 1, 8)
    assert pointwise_kernel.rotate(x.double(), cos.double(), cos.double()) is None
    assert pointwise_kernel.rotate(x.view(1, 3, 2, 8), cos.view(1, 3, 1, 8), cos.view(1, 3, 1, 8)) is None
    assert pointwise_kernel.rotate(x.clone().requires_grad_(), cos, cos) is None  # autograd (the drafter's training)
    assert pointwise_kernel.rms_norm(x.double(), torch.ones(8, dtype=torch.float64), 1e-6) is None
    assert pointwise_kernel.rms_norm(x.bfloat16(), torch.ones(8), 1e-6) is None  # mixed dtypes
    norm = model.RMSNorm(8, 1e-6)  # a trainable weight: autograd takes torch's path, with a gradient
    out = norm(x)
    out.sum().backward()
    assert norm.weight.grad is not None
