"""The small float32 linear kernel (rollout/kernels/linear_kernel.py): the same map as nn.Linear, one
chain of fused multiply-adds per output so a row's bits never depend on what shares the call
(MKL's sgemm gives one to three rows other bits), and the engine's model gives a token the same
logits alone as in a batch."""
import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

from rollout.core.batch import ForwardBatch
from rollout.core.model import CausalLM
from rollout.kernels import linear_kernel
from rollout.kernels.linear import PackedLinear, bound
from tests.conftest import tiny_hf_model

LIBRARY = linear_kernel.load()
pytestmark = pytest.mark.skipif(LIBRARY is None,
                                reason="the linear kernel needs a C compiler and AVX-512 or AVX2 with FMA")


def small_layer(n_in, n_out, bias, seed=0):
    torch.manual_seed(seed)
    return PackedLinear(n_in, n_out, bias=bias).requires_grad_(False)


@pytest.mark.parametrize("n_in,n_out,bias", [(128, 128, True), (37, 102, False), (256, 70, True), (16, 1, True),
                                             (48, 200, False)])
def test_the_same_map_as_nn_linear(n_in, n_out, bias):
    m = small_layer(n_in, n_out, bias)
    x = torch.randn(23, n_in)
    with torch.inference_mode():
        got = m(x)
    assert m.__dict__["_packed"][2] is not None  # the kernel ran, not torch's own linear
    ref = F.linear(x.double(), m.weight.double(), None if m.bias is None else m.bias.double())
    assert got.dtype == torch.float32 and got.shape == (23, n_out)
    assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(m(x[:0]), torch.empty(0, n_out))


@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_has_the_same_bits_whatever_shares_the_call(threads):
    m = small_layer(128, 102, True)
    x = torch.randn(70, 128)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            ref = m(x[:1])[0]
            for n in range(2, 71):
                assert torch.equal(m(x[:n])[0], ref), n
                assert torch.equal(m(torch.cat([x[1:n], x[:1]]))[-1], ref), n  # the same row last
            assert torch.equal(m(x.view(7, 10, 128))[0, 0], ref)  # leading dimensions are rows too
    finally:
        torch.set_num_threads(before)


def test_a_bound_weight_runs_as_a_layer_with_that_weight():
    # The draft head runs its projections packed into one weight through `bound`.
    m = small_layer(96, 48, True)
    x = torch.randn(9, 96)
    with torch.inference_mode():
        assert torch.equal(bound(m.weight, m.bias)(x), m(x))
        wide = torch.cat([m.weight, 2 * m.weight])
        assert torch.equal(bound(wide, torch.cat([m.bias, m.bias]))(x)[:, :48], m(x))  # a column's own bits
        ref = F.linear(x.double(), m.weight.double(), m.bias.double())
        assert torch.equal(bound(m.weight.double(), m.bias.double())(x.double()), ref)  # no kernel: torch's


def test_the_pack_follows_in_place_writes_and_new_biases():
    m = small_layer(64, 40, True)
    x, bias = torch.randn(3, 64), m.bias.clone()
    with torch.inference_mode():
        before = m(x)
    with torch.no_grad():  # as update_weights writes
        m.weight.mul_(2.0)
        m.bias.zero_()
    with torch.inference_mode():
        assert torch.allclose(m(x), 2 * (before - bias), rtol=1e-5, atol=1e-5)
    m.bias = torch.nn.Parameter(torch.ones(40), requires_grad=False)
    with torch.inference_mode():
        assert torch.allclose(m(x), 2 * (before - bias) + 1, rtol=1e-5, atol=1e-5)


def test_a_token_alone_has_the_logits_it_has_in_a_batch():
    """One decoding token in a forward of its own, and beside two others (three rows: the row
    counts at which MKL's sgemm takes other kernels) and in a verify-sized batch."""
    model = CausalLM.from_pretrained(tiny_hf_model("llama", seed=1))
    seqs = [torch.randint(0, 101, (8,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(3)]

    def last_logits(feed_more):
        cache = model.new_cache(3, 32)
        model(ForwardBatch.build([(s, 0, seqs[s][:7]) for s in range(3)], [], "cpu"), cache)
        rows = [(0, 7, seqs[0][7:])] + [(s, 7, seqs[s][7:] * feed_more) for s in (1, 2)][:2 if feed_more else 0]
        n = sum(len(r[2]) for r in rows)
        logits, _ = model(ForwardBatch.build(rows, list(range(n)), "cpu"), cache)
        return logits[0]

    alone = last_logits(0)
    assert torch.equal(last_logits(1), alone)
    assert torch.equal(last_logits(9), alone)


def test_a_copied_layer_repacks_and_gives_the_same_bits():
    m = small_layer(48, 30, True)
    x = torch.randn(5, 48)
    with torch.inference_mode():
        y = m(x)  # the pack (and the library handle, which does not pickle) now sit on the module
    for other in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        with torch.inference_mode():
            assert torch.equal(other(x), y)
