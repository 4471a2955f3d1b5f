"""bfloat16 linear layers on AMX tiles (rollout/kernels/amx_linear.py): the same map as F.linear within
bfloat16's rounding, and a row's bits independent of the rows that share the call, of its position
and of the thread count; the engine's bfloat16 layers take it where the CPU has AMX."""
import pytest
import torch
import torch.nn.functional as F

from rollout.kernels import amx_linear, linear

pytestmark = pytest.mark.skipif(amx_linear.load() is None,
                                reason="no AMX tiles here (CPU without AMX-BF16, or the kernel could not be built)")

# (outputs, inputs): whole tiles, a ragged last panel and k block, a model's wide layers
SHAPES = [(64, 128), (37, 40), (100, 200), (1376, 512), (512, 1376)]


def weights(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
    return w, torch.randn(n, generator=g).bfloat16(), (torch.randn(300, k, generator=g) * 3).bfloat16()


@pytest.mark.parametrize("n,k", SHAPES)
def test_the_same_map_as_f_linear_to_bfloat16_rounding(n, k):
    w, b, x = weights(n, k)
    route = linear.make_route(w)
    got = route(x[:37], b)
    ref = F.linear(x[:37].double(), w.double(), b.double())
    assert got.dtype == torch.bfloat16 and got.shape == (37, n)
    # one bfloat16 rounding of the result (2^-8 relative) and float32 sums
    assert torch.allclose(got.double(), ref, rtol=2 ** -8, atol=1e-3)
    assert torch.equal(route(x[:5], None), (route(x[:5], torch.zeros_like(b))))


@pytest.mark.parametrize("n,k", SHAPES)
def test_a_row_has_the_same_bits_in_any_call_and_on_any_thread_count(n, k):
    w, b, x = weights(n, k, seed=1)
    route = linear.make_route(w)
    ref = route(x, b)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            for rows in list(range(1, 40)) + [47, 64, 65, 97, 130, 299]:
                start = (rows * 7) % (300 - rows)
                assert torch.equal(route(x[start:start + rows], b), ref[start:start + rows]), (t, rows)
    finally:
        torch.set_num_threads(threads)


def test_the_engine_layers_take_it_in_bfloat16_only():
    m = linear.PackedLinear(128, 96).to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(3, 128).bfloat16()
    with torch.inference_mode():
        y = m(x)
    assert m._packed[2].func is amx_linear.linear
    w = m.weight.float()
    assert linear.make_route(w) is None or linear.make_route(w).func is not amx_linear.linear
    assert torch.equal(y, amx_linear.linear(amx_linear.load(), amx_linear.pack(amx_linear.load(), m.weight), 96, x,
                                            m.bias))
