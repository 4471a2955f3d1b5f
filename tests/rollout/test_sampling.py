"""The coupled sampler: exact samples, reproducible, and blind to the rest of the batch.

Distribution tests are chi-square goodness-of-fit tests at a strict alpha over tens of
thousands of seeds; `test_chi_square_rejects_*` show that the same test does catch a wrong
sampler, so a pass means something. Everything is deterministic (fixed seeds, no global
RNG state leaks into the sampler), so these tests never flake: a failure is a real change.
"""
from __future__ import annotations

import math

import pytest
import torch

from rollout.config import SamplingParams
from rollout.core import sampling
from rollout.core.sampling import gumbel_noise, process_logits, sample, sampling_tensors

ALPHA = 1e-4
EULER_GAMMA = 0.5772156649015329
N_SAMPLES = 30_000  # below torch's parallel grain (32768): small ops stay single-threaded
MAX_SEED = 2**63 - 1

# A fixed logit row, spread so every token has enough expected count for the chi-square
# approximation (smallest probability at T=0.7 is ~1%).
Z = torch.tensor([1.3, -0.4, 0.2, 2.0, 0.9, -1.1, 0.0, 1.6, -0.7, 0.5])
V = Z.numel()


# ------------------------------------------------------------------------------- helpers

def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P(chi2_{dof} >= statistic) for observed counts against probabilities (support only)."""
    counts = counts.to(torch.float64)
    probs = probs.to(torch.float64)
    expected = counts.sum() * probs
    stat = ((counts - expected) ** 2 / expected).sum()
    dof = torch.tensor((probs.numel() - 1) / 2, dtype=torch.float64)
    return torch.special.gammaincc(dof, stat / 2).item()


def full(n, value, dtype):
    return torch.full((n,), value, dtype=dtype)


def draw(z, n, temperature=1.0, top_k=0, top_p=1.0, seeds=None, positions=None):
    """Tokens of n rows that share the logit row z, by default seeds 0..n-1 at position 7."""
    seeds = torch.arange(n, dtype=torch.int64) if seeds is None else seeds
    positions = full(n, 7, torch.int64) if positions is None else positions
    tokens, _ = sample(z.expand(n, -1), seeds, positions, full(n, temperature, torch.float32),
                       full(n, top_k, torch.int64), full(n, top_p, torch.float32))
    return tokens


def reference_kept(z_row: torch.Tensor, temperature: float, top_k: int, top_p: float) -> list[int]:
    """A plain per-row loop, written from the spec: the kept token ids."""
    t = temperature if temperature > 0 else 1.0
    zs = (z_row.to(torch.float32) / torch.tensor(t, dtype=torch.float32)).tolist()
    n = len(zs)
    order = sorted(range(n), key=lambda v: (-zs[v], v))  # ties: lower id first
    if 0 < top_k < n:
        order = order[:top_k]
    p = float(torch.tensor(top_p, dtype=torch.float32))  # the float32 value the sampler sees
    if p < 1.0:
        top = zs[order[0]]
        weights = [math.exp(zs[v] - top) for v in order]
        total = sum(weights)
        kept, mass = [], 0.0
        for v, w in zip(order, weights):
            if kept and mass >= p:
                break
            kept.append(v)
            mass += w / total
        order = kept
    return sorted(order)


def reference_probs(z_row, temperature, top_k=0, top_p=1.0) -> torch.Tensor:
    """float64 softmax(z / T) renormalised over the reference kept set; 0 elsewhere."""
    kept = reference_kept(z_row, temperature, top_k, top_p)
    scaled = z_row.to(torch.float64) / temperature
    probs = torch.zeros_like(scaled)
    probs[kept] = torch.softmax(scaled[kept], dim=0)
    return probs


def assert_fits(tokens, probs):
    counts = torch.bincount(tokens, minlength=probs.numel()).to(torch.float64)
    support = probs > 0
    assert counts[~support].sum() == 0, f"dropped tokens were sampled: {counts[~support]}"
    p = chi_square_pvalue(counts[support], probs[support])
    assert p > ALPHA, f"chi-square p = {p:.3g}; counts {counts.tolist()} vs expected {(probs * len(tokens)).tolist()}"


def mixed_batch(m=37, vocab=3000, seed=0, sparse_filters=False):
    """Rows with every kind of params, some greedy, some with ties, extreme seeds.
    sparse_filters: only every fourth row uses top-k / top-p (sorting big rows is slow)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(m, vocab, generator=g) * 3
    logits[::5] = (logits[::5] * 2).round() / 2  # some rows full of ties
    seeds = torch.randint(0, 2**62, (m,), generator=g) * 2 + torch.randint(0, 2, (m,), generator=g)
    seeds[0], seeds[1] = MAX_SEED, 0
    positions = torch.randint(0, 4096, (m,), generator=g)
    temperature = torch.tensor([[0.0, 1.0, 0.7, 1.3][i % 4] for i in range(m)], dtype=torch.float32)
    top_k = torch.tensor([[0, 0, 50, 1, 0, 7][i % 6] for i in range(m)], dtype=torch.int64)
    top_p = torch.tensor([[1.0, 0.9, 1.0, 0.5, 0.95][i % 5] for i in range(m)], dtype=torch.float32)
    if sparse_filters:
        top_k[torch.arange(m) % 4 != 2] = 0
        top_p[torch.arange(m) % 4 != 1] = 1.0
    return logits, seeds, positions, temperature, top_k, top_p


# ------------------------------------------------------------------ the chi-square test itself

def test_chi_square_pvalue_matches_tables():
    # chi2 critical values: 9 dof at 0.01 is 21.666, 1 dof at 0.05 is 3.841
    probs = torch.full((10,), 0.1, dtype=torch.float64)
    # counts with statistic exactly 21.666: one bin off by d, another by -d -> 2 d^2 / e
    e = 1000.0
    d = math.sqrt(21.666 * e / 2)
    counts = torch.full((10,), e, dtype=torch.float64)
    counts[0] += d
    counts[1] -= d
    assert chi_square_pvalue(counts, probs) == pytest.approx(0.01, rel=1e-3)
    d = math.sqrt(3.841 * 500.0 / 2)
    half = torch.tensor([0.5, 0.5])
    assert chi_square_pvalue(torch.tensor([500.0 + d, 500.0 - d]), half) == pytest.approx(0.05, rel=1e-3)


def test_chi_square_rejects_the_wrong_temperature():
    tokens = draw(Z, N_SAMPLES, temperature=1.0)
    counts = torch.bincount(tokens, minlength=V)
    assert chi_square_pvalue(counts, reference_probs(Z, 0.8)) < ALPHA
    assert chi_square_pvalue(counts, reference_probs(Z, 1.0)) > ALPHA


def test_chi_square_rejects_a_slightly_biased_sampler():
    # 3% of the draws replaced by uniform tokens: a small bias the test must still see
    tokens = draw(Z, N_SAMPLES, temperature=1.0)
    g = torch.Generator().manual_seed(1)
    swap = torch.rand(N_SAMPLES, generator=g) < 0.03
    tokens = torch.where(swap, torch.randint(0, V, (N_SAMPLES,), generator=g), tokens)
    assert chi_square_pvalue(torch.bincount(tokens, minlength=V), reference_probs(Z, 1.0)) < ALPHA


# ------------------------------------------------------------------- exact sampling

@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, 0, 1.0),
    (0.7, 0, 1.0),
    (1.0, 4, 1.0),
    (0.7, 0, 0.8),
    (1.3, 6, 0.7),
])
def test_samples_follow_the_processed_distribution(temperature, top_k, top_p):
    probs = reference_probs(Z, temperature, top_k, top_p)
    if top_k or top_p < 1:
        assert (probs == 0).any()  # the case really drops something
    assert_fits(draw(Z, N_SAMPLES, temperature, top_k, top_p), probs)


@pytest.mark.parametrize("seeds, positions", [
    # one seed, many positions: the noise is independent across t
    (full(N_SAMPLES, 123456789, torch.int64), torch.arange(N_SAMPLES, dtype=torch.int64)),
    # seeds near 2**63 - 1
    (MAX_SEED - torch.arange(N_SAMPLES, dtype=torch.int64), None),
    # seeds that differ only in their high 32 bits: a hash of the low half would see one seed
    (torch.arange(N_SAMPLES, dtype=torch.int64) << 32, None),
], ids=["positions", "large_seeds", "high_bits"])
def test_samples_follow_softmax_whatever_varies(seeds, positions):
    assert_fits(draw(Z, N_SAMPLES, 1.0, seeds=seeds, positions=positions), reference_probs(Z, 1.0))


@pytest.mark.parametrize("other", ["next_position", "next_seed", "seed_high_bit"])
def test_draws_of_related_keys_are_independent(other):
    """Joint (token at key, token at related key) fits the product of the marginals."""
    z = torch.tensor([0.3, -0.5, 0.9, 0.0])
    n = N_SAMPLES
    seeds = torch.arange(n, dtype=torch.int64) * 2  # even seeds, so seed + 1 is unused
    positions = full(n, 3, torch.int64)
    if other == "next_position":
        seeds2, positions2 = seeds, positions + 1
    elif other == "next_seed":
        seeds2, positions2 = seeds + 1, positions
    else:
        seeds2, positions2 = seeds | (1 << 62), positions
    a = draw(z, n, seeds=seeds, positions=positions)
    b = draw(z, n, seeds=seeds2, positions=positions2)
    p = torch.softmax(z.double(), 0)
    assert_fits(a * 4 + b, torch.outer(p, p).flatten())


# ------------------------------------------------------------------- the noise

def test_gumbel_noise_moments_and_cdf():
    seeds = torch.arange(100, dtype=torch.int64) * 7919
    g = gumbel_noise(seeds, torch.arange(100, dtype=torch.int64), 10_000)
    assert g.dtype == torch.float32 and g.shape == (100, 10_000)
    assert torch.isfinite(g).all()
    x = g.double().flatten()
    n = x.numel()
    # mean: sd = 1.28 / 1000; var: sd ~ 1.645 * sqrt(4.4 / n) = 0.0035
    assert x.mean().item() == pytest.approx(EULER_GAMMA, abs=0.008)
    assert x.var().item() == pytest.approx(math.pi**2 / 6, abs=0.02)
    for q in [-1.0, 0.0, 1.0, 2.0, 4.0, 6.0]:
        cdf = math.exp(-math.exp(-q))
        sd = math.sqrt(cdf * (1 - cdf) / n)
        assert (x <= q).double().mean().item() == pytest.approx(cdf, abs=6 * sd)


def test_gumbel_noise_within_one_long_row():
    g = gumbel_noise(torch.tensor([42]), torch.tensor([0]), 200_000)[0].double()
    assert g.mean().item() == pytest.approx(EULER_GAMMA, abs=0.015)
    assert g.var().item() == pytest.approx(math.pi**2 / 6, abs=0.04)
    lag1 = torch.corrcoef(torch.stack([g[:-1], g[1:]]))[0, 1].item()
    assert abs(lag1) < 0.015  # sd 1 / sqrt(2e5) = 0.0022


def test_distinct_seed_and_position_give_distinct_noise():
    seed_list = [0, 1, 2, 3, 1 << 32, (1 << 32) + 1, 2 << 32, 1 << 62, (1 << 62) + 1,
                 MAX_SEED, MAX_SEED - 1, MAX_SEED ^ (1 << 40), 12345]
    pos_list = [0, 1, 2, 1023, 1 << 31, 1 << 32]
    seeds = torch.tensor([s for s in seed_list for _ in pos_list], dtype=torch.int64)
    positions = torch.tensor([t for _ in seed_list for t in pos_list], dtype=torch.int64)
    r, vocab = seeds.numel(), 8192
    g = gumbel_noise(seeds, positions, vocab)
    assert torch.isfinite(g).all()
    # No row is correlated with another (sd of a correlation: 1 / sqrt(8192) = 0.011) ...
    corr = torch.corrcoef(g.double()) - torch.eye(r, dtype=torch.float64)
    assert corr.abs().max().item() < 0.06
    # ... nor a reshuffle of another: two rows share only the few float32 values that chance
    # gives (about one per pair), where a permuted row would share all 8192.
    values, order = g.flatten().sort()
    row = order // vocab
    tie = (values[1:] == values[:-1]) & (row[1:] != row[:-1])
    pair = torch.minimum(row[1:], row[:-1])[tie] * r + torch.maximum(row[1:], row[:-1])[tie]
    assert torch.bincount(pair, minlength=r * r).max().item() <= 12


def test_gumbel_noise_is_a_pure_function_of_seed_position_token():
    seeds = torch.tensor([5, MAX_SEED, 0, 5], dtype=torch.int64)
    positions = torch.tensor([9, 0, 0, 9], dtype=torch.int64)
    g = gumbel_noise(seeds, positions, 1000)
    assert torch.equal(g, gumbel_noise(seeds, positions, 1000))
    assert torch.equal(g[0], g[3])
    # a row alone, or with a larger vocabulary (its prefix), is the same noise
    assert torch.equal(gumbel_noise(seeds[1:2], positions[1:2], 1000)[0], g[1])
    assert torch.equal(gumbel_noise(seeds, positions, 3000)[:, :1000], g)


# ---------------------------------------------------------------- determinism and batches

def test_same_inputs_same_outputs():
    batch = mixed_batch()
    t1, l1 = sample(*batch)
    t2, l2 = sample(*batch)
    assert torch.equal(t1, t2) and torch.equal(l1, l2)


@pytest.mark.parametrize("m, vocab, chunk_elements, group_sizes", [
    # forced small CPU chunks (3 rows), so rows land in different chunks each time
    (37, 500, 3 * 500, [1, 1, 2, 3, 5, 8, 17]),
    # the default chunking at a realistic vocabulary size (10 rows per chunk)
    (12, 50_000, None, [1, 2, 9]),
])
def test_rows_do_not_depend_on_the_rest_of_the_batch(m, vocab, chunk_elements, group_sizes, monkeypatch):
    if chunk_elements is not None:
        monkeypatch.setattr(sampling, "_CPU_CHUNK_ELEMENTS", chunk_elements)
    batch = mixed_batch(m, vocab, sparse_filters=vocab > 10_000)
    seeds, positions = batch[1], batch[2]
    tokens, logprobs = sample(*batch)
    noise = gumbel_noise(seeds, positions, vocab)
    # every row again, in a shuffled batch of another size (singles included)
    perm = torch.randperm(m, generator=torch.Generator().manual_seed(3))
    for idx in perm.split(group_sizes):
        t, lp = sample(*(x[idx] for x in batch))
        assert torch.equal(t, tokens[idx]) and torch.equal(lp, logprobs[idx]), idx
        assert torch.equal(gumbel_noise(seeds[idx], positions[idx], vocab), noise[idx]), idx
    # inside a bigger batch that repeats rows
    idx = torch.cat([perm, torch.arange(m), perm[:5]])
    t, lp = sample(*(x[idx] for x in batch))
    assert torch.equal(t, tokens[idx]) and torch.equal(lp, logprobs[idx])
    # chunking is invisible: one chunk for everything gives the same bits
    monkeypatch.setattr(sampling, "_CPU_CHUNK_ELEMENTS", 1 << 40)
    t, lp = sample(*batch)
    assert torch.equal(t, tokens) and torch.equal(lp, logprobs)
    assert torch.equal(gumbel_noise(seeds, positions, vocab), noise)


def test_sample_is_argmax_of_processed_plus_noise():
    logits, seeds, positions, temperature, top_k, top_p = batch = mixed_batch()
    tokens, logprobs = sample(*batch)
    z = process_logits(logits, temperature, top_k, top_p)
    noisy = (z + gumbel_noise(seeds, positions, logits.shape[1])).argmax(-1)
    expected = torch.where(temperature > 0, noisy, z.argmax(-1))
    assert torch.equal(tokens, expected)
    assert torch.equal(logprobs, torch.log_softmax(z, -1).gather(1, tokens[:, None]).squeeze(1))
    assert torch.isfinite(z.gather(1, tokens[:, None])).all()  # never a dropped token


def test_logprobs_match_a_float64_reference():
    logits, seeds, positions, temperature, top_k, top_p = batch = mixed_batch(m=24, vocab=300)
    tokens, logprobs = sample(*batch)
    assert logprobs.dtype == torch.float32
    for i in range(logits.shape[0]):
        t = temperature[i].item() or 1.0
        kept = reference_kept(logits[i], temperature[i].item(), top_k[i].item(), top_p[i].item())
        assert tokens[i].item() in kept
        ref = torch.log_softmax(logits[i].double()[kept] / t, 0)[kept.index(tokens[i].item())]
        assert logprobs[i].item() == pytest.approx(ref.item(), abs=2e-5), i


# ------------------------------------------------------------------ greedy and processing

def test_temperature_zero_is_argmax_with_first_index_on_ties():
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(64, 40, generator=g) * 2).round()  # many ties
    logits[0, :] = 1.0  # all tied -> token 0
    m = logits.shape[0]
    seeds = torch.randint(0, 2**62, (m,), generator=g)
    tokens, logprobs = sample(logits, seeds, torch.zeros(m, dtype=torch.int64), torch.zeros(m),
                              full(m, 0, torch.int64), torch.ones(m))
    rows = logits.tolist()
    expected = [max(range(40), key=lambda v: (row[v], -v)) for row in rows]
    assert tokens.tolist() == expected
    # logprob under the T = 1 distribution
    ref = torch.log_softmax(logits.double(), -1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs.double(), ref, atol=2e-6, rtol=0)
    # and the seed is irrelevant
    t2, _ = sample(logits, seeds + 1, torch.ones(m, dtype=torch.int64), torch.zeros(m),
                   full(m, 0, torch.int64), torch.ones(m))
    assert torch.equal(t2, tokens)


@pytest.mark.parametrize("candidates", [(), (20,), (4, 12)])
def test_kept_sets_match_a_per_row_reference_including_ties(candidates, monkeypatch):
    # (): every row is fully sorted. Otherwise rows are first cut among their largest
    # logits, and those whose cut is not provably there move on to more, then a full sort.
    monkeypatch.setattr(sampling, "_TOP_CANDIDATES", candidates)
    g = torch.Generator().manual_seed(11)
    rows, vocab = 240, 60
    logits = torch.randn(rows, vocab, generator=g) * 2
    logits[::2] = (logits[::2] * 2).round() / 2  # half the rows full of ties
    logits[3] = 0.0  # one row entirely tied
    temperature = torch.tensor([[0.0, 0.5, 1.0, 1.7][i % 4] for i in range(rows)], dtype=torch.float32)
    ks = [0, 1, 2, 5, 17, vocab - 1, vocab, vocab + 3]
    ps = [1.0, 0.3, 0.61, 0.9, 0.97]
    top_k = torch.tensor([ks[(i * 7) % len(ks)] for i in range(rows)], dtype=torch.int64)
    top_p = torch.tensor([ps[(i // 3) % len(ps)] for i in range(rows)], dtype=torch.float32)
    top_p[::11] = torch.rand(len(top_p[::11]), generator=g) * 0.98 + 0.01
    z = process_logits(logits, temperature, top_k, top_p)
    assert z.dtype == torch.float32
    t_eff = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scaled = logits / t_eff[:, None]
    for i in range(rows):
        kept = reference_kept(logits[i], temperature[i].item(), top_k[i].item(), top_p[i].item())
        got = torch.isfinite(z[i]).nonzero().squeeze(1).tolist()
        assert got == kept, (i, temperature[i].item(), top_k[i].item(), top_p[i].item())
        assert torch.equal(z[i, kept], scaled[i, kept])  # kept tokens are exactly z / T
        assert (z[i, torch.isinf(z[i])] == float("-inf")).all()
    assert len(reference_kept(logits[3], 1.0, 5, 1.0)) == 5  # ties at the cut: exactly k


def test_fast_path_is_z_over_t_and_leaves_the_input_alone():
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    temperature = torch.tensor([1.0, 0.0, 0.5, 2.0, 1.0, 0.3])
    z = process_logits(logits, temperature, full(6, 0, torch.int64), torch.ones(6))
    t_eff = torch.tensor([1.0, 1.0, 0.5, 2.0, 1.0, 0.3])
    assert torch.equal(z, logits / t_eff[:, None])
    z.zero_()
    assert torch.equal(logits, before)  # a new tensor, never a view of the input
    # top_k >= V and top_p == 1 are "off"
    z = process_logits(logits, temperature, full(6, 30, torch.int64), torch.ones(6))
    assert torch.isfinite(z).all()


def test_other_logit_dtypes_are_cast_to_float32_first():
    logits, seeds, positions, temperature, top_k, top_p = mixed_batch(m=12, vocab=500)
    for dtype in [torch.float64, torch.bfloat16, torch.float16]:
        x = (logits * 1.001).to(dtype)
        t1, l1 = sample(x, seeds, positions, temperature, top_k, top_p)
        t2, l2 = sample(x.to(torch.float32), seeds, positions, temperature, top_k, top_p)
        assert torch.equal(t1, t2) and torch.equal(l1, l2), dtype
        assert l1.dtype == torch.float32 and t1.dtype == torch.int64


def test_large_seeds_work():
    seeds = torch.tensor([MAX_SEED, MAX_SEED - 1, 2**62, 2**63 - 2**32], dtype=torch.int64)
    positions = torch.tensor([0, 0, 100_000, 7], dtype=torch.int64)
    g = gumbel_noise(seeds, positions, 5000)
    assert torch.isfinite(g).all()
    assert not torch.equal(g[0], g[1])
    m, vocab = 4, 5000
    tokens, logprobs = sample(torch.zeros(m, vocab), seeds, positions, torch.ones(m),
                              full(m, 0, torch.int64), torch.ones(m))
    assert ((0 <= tokens) & (tokens < vocab)).all()
    assert torch.allclose(logprobs, torch.full((m,), -math.log(vocab)))


def test_empty_batch():
    tokens, logprobs = sample(torch.zeros(0, 10), torch.zeros(0, dtype=torch.int64),
                              torch.zeros(0, dtype=torch.int64), torch.zeros(0),
                              torch.zeros(0, dtype=torch.int64), torch.zeros(0))
    assert tokens.shape == (0,) and logprobs.shape == (0,)
    assert gumbel_noise(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), 10).shape == (0, 10)


def test_sampling_tensors_from_params():
    params = [SamplingParams(temperature=0.7, top_k=5, top_p=0.9), SamplingParams(),
              SamplingParams(temperature=0.0)]
    temperature, top_k, top_p = sampling_tensors(params, "cpu")
    assert temperature.dtype == torch.float32 and top_k.dtype == torch.int64 and top_p.dtype == torch.float32
    assert temperature.tolist() == pytest.approx([0.7, 1.0, 0.0])
    assert top_k.tolist() == [5, 0, 0]
    assert top_p.tolist() == pytest.approx([0.9, 1.0, 1.0])


@pytest.mark.parametrize("p", [1e-46, 5e-324])
def test_a_top_p_that_rounds_to_zero_keeps_the_top_token(p):
    """float32(p) == 0: nothing reaches the mass, yet the top token must stay (found by fuzzing:
    every token was dropped, and the sample was token 0 with a NaN logprob)."""
    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5], [3.0, 3.0, 0.0, -2.0]])
    z = process_logits(logits, torch.ones(2), torch.zeros(2, dtype=torch.int64), torch.full((2,), p))
    assert torch.isfinite(z).sum(dim=1).tolist() == [1, 1]
    tokens, logprobs = sample(logits, torch.tensor([1, 2]), torch.tensor([0, 0]), torch.ones(2),
                              torch.zeros(2, dtype=torch.int64), torch.full((2,), p))
    assert tokens.tolist() == [1, 0] and logprobs.tolist() == [0.0, 0.0]
