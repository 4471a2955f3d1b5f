"""The CPU noise kernel gives the torch reference's bits, and sampling without it the same tokens.

rollout/kernels/noise_kernel.c and sampling._log_exponential_ spell out one arithmetic (integer hashing,
correctly rounded +, -, *, /); any difference in a constant, an order of operations or a
contraction shows up here as unequal bits. Where no C compiler exists the kernel tests skip and
the engine runs the reference, which the last tests pin down.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.core import sampling
from rollout.kernels import c_kernels, noise_kernel

CPU = torch.device("cpu")


def kernel_or_skip():
    kernel = noise_kernel.load()
    if kernel is None:
        pytest.skip("the CPU noise kernel could not be built here (no C compiler?)")
    return kernel


def reference_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    a, b = sampling._row_keys(seeds, positions)
    out = torch.empty(len(seeds), vocab)
    scratch = sampling._scratch(len(seeds), vocab, CPU)
    return sampling._log_exponential_(a, b, sampling._vocab_keys(vocab, CPU), out, scratch).neg_()


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 9), vocab=st.integers(1, 3000), seed=st.integers(0, 2**63 - 1),
       position=st.integers(0, 2**40))
def test_kernel_noise_is_the_reference_bit_for_bit(rows, vocab, seed, position):
    kernel = kernel_or_skip()
    seeds = torch.tensor([(seed + 7919 * i) % 2**63 for i in range(rows)])
    positions = torch.arange(position, position + rows)
    got = noise_kernel.gumbel(kernel, seeds, positions, sampling.vocab_keys32(vocab), torch.empty(rows, vocab))
    assert torch.equal(got, reference_noise(seeds, positions, vocab))


def test_kernel_noise_is_the_reference_at_a_real_vocabulary():
    kernel = kernel_or_skip()
    seeds, positions = torch.arange(6) * 1_000_003, torch.arange(6) * 977
    got = noise_kernel.gumbel(kernel, seeds, positions, sampling.vocab_keys32(49_157), torch.empty(6, 49_157))
    assert torch.equal(got, reference_noise(seeds, positions, 49_157))


def perturbed_argmax(z: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The kernel's tokens, after checking its margins against torch's (drafter/coupled.py's way)."""
    kernel = kernel_or_skip()
    keys = sampling.vocab_keys32(z.shape[1])
    margins = torch.empty(z.shape[0])
    tokens = noise_kernel.perturbed_argmax(kernel, seeds, positions, keys, z.contiguous(), margins)
    assert torch.equal(noise_kernel.perturbed_argmax(kernel, seeds, positions, keys, z.contiguous()), tokens)
    scores = z + reference_noise(seeds, positions, z.shape[1])
    best = scores.gather(1, tokens[:, None]).squeeze(1)
    second = scores.scatter(1, tokens[:, None], float("-inf")).amax(dim=-1)
    torch.testing.assert_close(margins, best - second, rtol=0, atol=0, equal_nan=True)
    return tokens


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 1000, 4099])
def test_kernel_argmax_is_torch_argmax_of_z_plus_noise(vocab):
    gen = torch.Generator().manual_seed(vocab)
    seeds, positions = torch.arange(20) * 31 + 5, torch.arange(20) + 3
    z = torch.randn(20, vocab, generator=gen) * 3
    z[1::3, ::2] = float("-inf")  # dropped tokens (top-k / top-p)
    z[2] = z[2].round()  # many equal logits
    if vocab > 1:
        z[3, :] = float("-inf")
        z[3, vocab // 2] = 0.0  # one kept token
    expected = (z + reference_noise(seeds, positions, vocab)).argmax(-1)
    assert torch.equal(perturbed_argmax(z, seeds, positions), expected)


def test_kernel_argmax_breaks_exact_ties_and_nans_as_torch_does():
    seeds, positions = torch.arange(3), torch.zeros(3, dtype=torch.int64)
    noise = reference_noise(seeds, positions, 40)
    z = -noise  # every score exactly 0 (z + G == z - log E, and -x + x == 0): the first index wins
    z[1, 25] = float("nan")  # torch.argmax takes the first NaN
    z[2, :] = float("-inf")  # nothing kept: index 0, as torch.argmax
    got = perturbed_argmax(z, seeds, positions)  # margins: 0 (a tie), NaN, NaN (-inf less -inf)
    assert torch.equal(got, (z + noise).argmax(-1))
    assert got.tolist() == [0, 25, 0]


def test_threads_do_not_change_the_kernel(monkeypatch):
    kernel_or_skip()
    seeds, positions = torch.arange(40) * 13, torch.arange(40)
    z = torch.randn(40, 2000, generator=torch.Generator().manual_seed(1))
    one = perturbed_argmax(z, seeds, positions)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)  # split into 4 row ranges
    assert torch.equal(perturbed_argmax(z, seeds, positions), one)


@pytest.mark.parametrize("dtype, low, high", [(torch.float64, 2.0**-33, 1.0), (torch.float32, 1e-10, 23.0)])
def test_the_written_out_log_is_within_a_few_ulp_of_torch_log(dtype, low, high):
    x = torch.logspace(torch.log10(torch.tensor(low)).item(), torch.log10(torch.tensor(high)).item(), 200_001,
                       dtype=torch.float64).to(dtype)
    x = x[x < 1] if dtype == torch.float64 else x  # u < 1 is the float64 log's whole domain
    ints = torch.int64 if dtype == torch.float64 else torch.int32
    ulps = (sampling._log_positive(x).view(ints).to(torch.int64) - torch.log(x).view(ints).to(torch.int64)).abs()
    assert int(ulps.max()) <= 4


def test_sampling_without_the_kernel_gives_the_same_tokens(monkeypatch):
    kernel_or_skip()
    gen = torch.Generator().manual_seed(5)
    m, vocab = 24, 3001
    logits = torch.randn(m, vocab, generator=gen) * 2
    seeds, positions = torch.arange(m) * 101, torch.arange(m) + 11
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3] * 6)
    top_k = torch.tensor([0, 0, 50, 0] * 6)
    top_p = torch.tensor([1.0, 0.9, 1.0, 1.0] * 6)
    with_kernel = sampling.sample(logits, seeds, positions, temperature, top_k, top_p)
    noise = sampling.gumbel_noise(seeds, positions, vocab)
    monkeypatch.setattr(noise_kernel, "load", lambda: None)
    without = sampling.sample(logits, seeds, positions, temperature, top_k, top_p)
    assert torch.equal(with_kernel[0], without[0]) and torch.equal(with_kernel[1], without[1])
    assert torch.equal(sampling.gumbel_noise(seeds, positions, vocab), noise)


def test_an_unbuildable_kernel_warns_and_sampling_goes_on(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setenv("SPECTAIL_KERNEL_DIR", str(tmp_path))
    c_kernels.load.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert noise_kernel.load() is None
        assert any("noise_kernel is unavailable" in str(w.message) for w in caught)
        assert list(tmp_path.iterdir()) == []  # no half-written library left behind
        tokens, _ = sampling.sample(torch.randn(3, 50), torch.arange(3), torch.zeros(3, dtype=torch.int64),
                                    torch.ones(3), torch.zeros(3, dtype=torch.int64), torch.ones(3))
        assert tokens.shape == (3,)
    finally:
        c_kernels.load.cache_clear()


def test_the_switch_turns_the_kernel_off(monkeypatch):
    monkeypatch.setenv("SPECTAIL_C_KERNELS", "0")
    c_kernels.load.cache_clear()
    try:
        assert noise_kernel.load() is None
    finally:
        c_kernels.load.cache_clear()
