"""Running requests are kept in slots ordered by context bucket, so attention reads the KV cache in
place instead of gathering it every step; moving a request's KV never changes a token."""
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rollout.core.engine as engine_module
from rollout import Engine, EngineConfig, SamplingParams, SpecConfig
from rollout.core.kv_cache import KVCache
from rollout.core.slot_order import arrange
from rollout.kernels import attention_kernel
from tests.conftest import tiny_hf_model


@st.composite
def layouts(draw):
    n = draw(st.integers(1, 24))
    slots = draw(st.lists(st.integers(0, 31), min_size=n, max_size=n, unique=True))
    keys = draw(st.lists(st.sampled_from([64, 128, 256, 512]), min_size=n, max_size=n))
    return slots, keys


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_arrange_gives_each_bucket_one_run_of_slots_largest_first_and_moves_only_misplaced(layout):
    slots, keys = layout
    new = arrange(slots, keys)
    assert sorted(new) == list(range(len(slots)))
    by_slot = [k for _, k in sorted(zip(new, keys))]
    assert by_slot == sorted(keys, reverse=True)  # one run per key, the largest in the lowest slots
    runs = {k: (by_slot.index(k), len(by_slot) - by_slot[::-1].index(k)) for k in set(keys)}
    for old, k, s in zip(slots, keys, new):
        lo, hi = runs[k]
        assert (s == old) == (lo <= old < hi)  # placed requests stay; every other one moves


def test_arrange_fills_a_run_in_the_order_of_the_current_slots():
    # the 128s' run is slots 2-3: the one in slot 3 stays, the one in slot 9 takes slot 2
    assert arrange([7, 3, 9, 0], [256, 128, 128, 256]) == [1, 3, 2, 0]


def test_move_copies_every_layer_and_may_swap_slots():
    cache = KVCache(num_layers=2, num_slots=4, max_len=8, num_kv_heads=2, head_dim=3, dtype=torch.float32,
                    device="cpu")
    for t in (*cache.k, *cache.v):
        t.copy_(torch.randn_like(t))
    before_k, before_v = [t.clone() for t in cache.k], [t.clone() for t in cache.v]
    cache.move([0, 1, 3], [1, 0, 2], length=5)
    for old, new in ((before_k, cache.k), (before_v, cache.v)):
        for b, a in zip(old, new):
            assert torch.equal(a[1, :, :5], b[0, :, :5]) and torch.equal(a[0, :, :5], b[1, :, :5])
            assert torch.equal(a[2, :, :5], b[3, :, :5]) and torch.equal(a[3], b[3])
            assert torch.equal(a[:3, :, 5:], b[:3, :, 5:])  # positions past length are left alone


def long_tail(n=20, seed=3):
    rng = random.Random(seed)
    prompts = [[rng.randrange(101) for _ in range(rng.randint(2, 12))] for _ in range(n)]
    params = [SamplingParams(temperature=1.0, max_tokens=rng.choice([4, 8, 30, 90, 150])) for _ in range(n)]
    return prompts, params


def gathered_groups(eng, prompts, params):
    """Tokens, and how many attention groups of decode rows had to gather their slots' KV."""
    build, gathers = engine_module.ForwardBatch.build, []

    def spy(*args, **kw):
        batch = build(*args, **kw)
        gathers.extend(g for g in batch.groups if g.first_slot is None and g.max_row_len == 1)
        return batch

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_module.ForwardBatch, "build", staticmethod(spy))
        outs = eng.generate(prompts, params, seeds=list(range(len(prompts))))
    return [o.token_ids for o in outs], len(gathers)


@pytest.mark.parametrize("spec", [None, SpecConfig(proposers=("ngram",), max_draft_tokens=4, min_draft_prob=0.0)])
def test_a_long_tail_rollout_reads_the_cache_in_place_with_the_same_tokens(monkeypatch, spec):
    # torch's attention on grids (the path of other devices, and of a CPU without a C compiler):
    # the CPU kernel reads each token's slot wherever it is, and the engine orders no slots for it
    monkeypatch.setattr(attention_kernel, "supports", lambda *a: False)
    eng = Engine.from_pretrained(tiny_hf_model("llama", seed=5),
                                 EngineConfig(max_batch_size=8, max_model_len=200, spec=spec))
    prompts, params = long_tail()
    assert eng.reorders_slots
    ordered, ordered_gathers = gathered_groups(eng, prompts, params)
    eng.reorders_slots = False
    scattered, scattered_gathers = gathered_groups(eng, prompts, params)
    assert ordered == scattered
    assert scattered_gathers > 0  # the workload scatters slots when nothing reorders them
    assert ordered_gathers == 0
