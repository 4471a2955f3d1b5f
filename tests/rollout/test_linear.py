"""The packed oneDNN linear layers (rollout/kernels/linear.py): the same map as nn.Linear, a row's bits
independent of how many rows share the call, and a pack that follows every change of the weight."""
import copy
import pickle

import pytest
import torch

from rollout.kernels import linear
from rollout.kernels.linear import PackedLinear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def layer(n_in=512, n_out=640, dtype=torch.float32, bias=True, seed=0):
    torch.manual_seed(seed)
    m = PackedLinear(n_in, n_out, bias=bias).to(dtype)
    m.requires_grad_(False)
    # bfloat16 packs only where oneDNN has its bfloat16 path; elsewhere torch's own matmul runs,
    # which must keep the same properties
    assert linear.packs(m.weight) == (dtype == torch.float32 or linear.onednn_bf16())
    return m


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_packed_is_the_same_map_as_nn_linear(dtype, tol):
    m = layer(dtype=dtype)
    x = torch.randn(37, 512).to(dtype)
    with torch.inference_mode():
        got = m(x)
    ref = torch.nn.functional.linear(x.double(), m.weight.double(), m.bias.double())
    assert got.dtype == dtype and got.shape == (37, 640)
    assert torch.allclose(got.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(512, 640), (1376, 512)])  # (1376, 512): wide input, one row differs unpadded
def test_a_row_has_the_same_bits_whatever_shares_the_call(dtype, shape):
    m = layer(*shape, dtype=dtype)
    x = torch.randn(300, shape[0]).to(dtype)
    with torch.inference_mode():
        ref = m(x[:1])[0]
        for n in list(range(2, 131)) + [140, 200, 300]:
            assert torch.equal(m(x[:n])[0], ref), n
            moved = torch.cat([x[1:n], x[:1]])  # the same row last
            assert torch.equal(m(moved)[-1], ref), n


def test_padding_is_exact_up_to_a_full_batch_and_a_small_share_above():
    assert [linear.padded_rows(n) for n in (1, 2, 65, linear.EXACT_ROWS)] == [2, 2, 65, linear.EXACT_ROWS]
    sizes = {linear.padded_rows(n) for n in range(1, 4097)}
    for n in range(linear.EXACT_ROWS + 1, 4097):
        rows = linear.padded_rows(n)
        assert n <= rows < n * (1 + 1 / linear.PAD_PARTS) and linear.padded_rows(rows) == rows
    assert len(sizes) <= linear.EXACT_ROWS + linear.PAD_PARTS * 5  # kernels per weight shape


def test_the_pack_follows_in_place_writes_and_replaced_weights():
    m = layer()
    x = torch.randn(3, 512)
    with torch.inference_mode():
        before = m(x)
    with torch.no_grad():
        m.weight.mul_(2.0)  # as update_weights / load_state_dict write
    with torch.inference_mode():
        assert torch.allclose(m(x) - m.bias, 2 * (before - m.bias), rtol=1e-5, atol=1e-5)
    m.weight = torch.nn.Parameter(torch.zeros_like(m.weight), requires_grad=False)
    with torch.inference_mode():
        assert torch.equal(m(x), m.bias.expand(3, -1))


def test_copies_and_gradients_take_the_plain_path_safely():
    m = layer()
    x = torch.randn(4, 512)
    with torch.inference_mode():
        y = m(x)
    for other in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        with torch.inference_mode():
            assert torch.equal(other(x), y)
    m.requires_grad_(True)
    out = m(x)  # autograd: the packed operator has no gradient
    out.sum().backward()
    assert m.weight.grad is not None and torch.allclose(out, y, rtol=1e-5, atol=1e-5)


def test_small_weights_are_not_packed_for_onednn():
    m = PackedLinear(128, 256)
    assert not linear.packs(m.weight)
    assert not linear.packs(layer().weight.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(512, 640), (32, 48)])  # packed (oneDNN or AMX) and small (linear_kernel)
def test_a_call_on_no_rows_returns_an_empty_result_on_every_path(dtype, shape):
    """A forward that asks no logits (the drafter's sequence_features) calls lm_head on 0 rows:
    oneDNN's path used to pad them from x[:1], which does not exist."""
    m = layer(*shape, dtype=dtype) if shape[0] * shape[1] >= linear.PACK_MIN_WEIGHTS else (
        PackedLinear(*shape).to(dtype).requires_grad_(False))
    for x in (torch.empty(0, shape[0], dtype=dtype), torch.empty(3, 0, shape[0], dtype=dtype)):
        with torch.inference_mode():
            got = m(x)
        assert got.shape == (*x.shape[:-1], shape[1]) and got.dtype == dtype
        route = linear.make_route(m.weight.detach().contiguous())
        if route is not None:
            assert route(x, m.bias).shape == got.shape
