"""Kept KV slots (rollout/core/kept_slots.py): a request paused by one run and continued by a later run
on the same engine resumes from its kept KV instead of prefilling again, and its tokens are the
plain engine's, token for token; stale KV (other weights, another context) is never reused."""
import random

import pytest

from rollout import EngineConfig, SamplingParams, SpecConfig
from tests.conftest import tiny_hf_model
from tests.rollout.test_engine import engine  # the same tiny engine

VOCAB = 101
SPEC = SpecConfig(proposers=("ngram", "suffix"), max_draft_tokens=3, min_draft_prob=0.0)


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("llama", vocab=VOCAB, seed=7)



def workload(n=6, seed=3):
    rng = random.Random(seed)
    prompts, groups = [], []
    for g in range(n // 2):
        base = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 8))] * rng.randint(1, 3)
        prompts += [base, base]
        groups += [g, g]
    params = [SamplingParams(temperature=1.0, max_tokens=rng.randint(10, 40)) for _ in prompts]
    return prompts, params, list(range(len(prompts))), groups


def chunked(eng, prompts, params, seeds, groups, chunk, keep=True):
    """Run in chunks of `chunk` new tokens, a new run each time, as a Ray worker does. Returns the
    requests and the tokens fed over all runs."""
    reqs = eng.make_requests(prompts, params, seeds=seeds, groups=groups)
    fed, keys = 0, [("r", i) for i in range(len(reqs))] if keep else None
    while any(r.finish_reason is None for r in reqs):
        fed += eng.run(reqs, max_new_tokens=chunk, keep=keys).fed_tokens
    eng.release_groups(set(groups))
    return reqs, fed


def test_resumed_requests_equal_the_plain_engine_and_skip_the_prefill(hf):
    prompts, params, seeds, groups = workload()
    ref = [o.token_ids for o in engine(hf, max_batch_size=6).generate(prompts, params, seeds=seeds)]
    eng = engine(hf, max_batch_size=2, kept_slots=6, spec=SPEC)
    reqs, fed_kept = chunked(eng, prompts, params, seeds, groups, chunk=5)
    assert [r.output_ids for r in reqs] == ref
    assert eng.kept.counts["resumed"] > 0 and eng.kept.counts["evicted"] == 0
    assert eng.kept.keys() == []  # every request finished: nothing of them is kept
    again, fed_plain = chunked(engine(hf, max_batch_size=2, spec=SPEC), prompts, params, seeds, groups, 5, keep=False)
    assert [r.output_ids for r in again] == ref
    assert fed_kept < fed_plain  # the work a re-prefill costs is gone


def test_eviction_keeps_the_most_recent_and_the_rest_re_prefill(hf):
    prompts, params, seeds, groups = workload(n=4, seed=5)
    params = [SamplingParams(temperature=1.0, max_tokens=30)] * 4
    ref = [o.token_ids for o in engine(hf, max_batch_size=4).generate(prompts, params, seeds=seeds)]
    eng = engine(hf, max_batch_size=4, kept_slots=1)
    reqs = eng.make_requests(prompts, params, seeds=seeds)
    keys = [("r", i) for i in range(4)]
    eng.run(reqs, max_new_tokens=6, keep=keys)
    assert eng.kept.counts["kept"] == 4 and eng.kept.counts["evicted"] == 3 and len(eng.kept.keys()) == 1
    eng.run(reqs, max_new_tokens=10, keep=keys)
    assert eng.kept.counts["resumed"] == 1
    eng.run(reqs, keep=keys)
    assert [r.output_ids for r in reqs] == ref


def test_kept_kv_is_dropped_when_the_weights_change(hf):
    other = tiny_hf_model("llama", vocab=VOCAB, seed=8)
    prompts, _, seeds, _ = workload(n=2, seed=9)
    params = SamplingParams(temperature=1.0, max_tokens=24)
    eng = engine(hf, max_batch_size=2, kept_slots=2)
    reqs = eng.make_requests(prompts, params, seeds=seeds)
    keys = ["a", "b"]
    eng.run(reqs, max_new_tokens=8, keep=keys)
    assert sorted(eng.kept.keys()) == keys
    eng.update_weights(other.state_dict())
    assert eng.kept.keys() == []
    prefix = [list(r.output_ids) for r in reqs]
    eng.run(reqs, keep=keys)
    assert eng.kept.counts["resumed"] == 0
    # the continuation under the new weights is a re-prefill of the same prefix on a fresh engine
    fresh = engine(other, max_batch_size=2)
    want = fresh.make_requests(prompts, params, seeds=seeds, outputs=prefix)
    fresh.run(want)
    assert [r.output_ids for r in reqs] == [r.output_ids for r in want]


def test_a_key_whose_context_differs_is_not_reused(hf):
    prompts, _, seeds, _ = workload(n=4, seed=11)
    prompts, seeds = prompts[::2], seeds[::2]  # two different prompts
    params = SamplingParams(temperature=1.0, max_tokens=20)
    ref = [o.token_ids for o in engine(hf, max_batch_size=2).generate(prompts, params, seeds=seeds)]
    eng = engine(hf, max_batch_size=2, kept_slots=2)
    (a,) = eng.make_requests(prompts[:1], params, seeds=seeds[:1])
    eng.run([a], max_new_tokens=6, keep=["k"])
    (b,) = eng.make_requests(prompts[1:], params, seeds=seeds[1:])  # another request, same key
    eng.run([b], keep=["k"])
    assert eng.kept.counts["mismatched"] == 1 and eng.kept.counts["resumed"] == 0
    assert b.output_ids == ref[1]
    # a request that went on elsewhere comes back longer: the kept prefix is still its own
    (c,) = eng.make_requests(prompts[:1], params, seeds=seeds[:1])
    eng.run([c], max_new_tokens=6, keep=["k"])
    kept_len = c.num_tokens - 1  # all but the last sampled token, which is fed next
    engine(hf, max_batch_size=2).run([c], max_new_tokens=5)  # "elsewhere": another engine
    eng.run([c], keep=["k"])
    assert eng.kept.counts["resumed"] == 1 and eng.kept.counts["resumed_tokens"] == kept_len
    assert c.output_ids == ref[0]


def test_a_step_limit_pauses_what_runs_and_returns_what_waits(hf):
    """max_steps: the chunk of a worker given more requests than slots. Every context is fed once
    over all the runs (each resumes from its kept KV), and the tokens are the plain engine's."""
    prompts, _, seeds, groups = workload(n=6, seed=17)
    params = SamplingParams(temperature=1.0, max_tokens=30)
    ref = [o.token_ids for o in engine(hf, max_batch_size=6).generate(prompts, params, seeds=seeds)]
    # (prompts not shared: a sibling would wait a step for its donor's prefill, and be fed less than once)
    eng = engine(hf, max_batch_size=2, kept_slots=2, spec=SPEC, share_prompts=False)
    reqs = eng.make_requests(prompts, params, seeds=seeds, groups=groups)
    keys = list(range(6))
    eng.run(reqs, keep=keys, max_steps=5)
    assert [len(r.output_ids) >= 5 for r in reqs] == [True, True, False, False, False, False]
    assert [r.output_ids for r in reqs[2:]] == [[]] * 4  # never admitted: as they came
    exact = engine(hf, max_batch_size=2, kept_slots=6, share_prompts=False)  # no drafts, room for every pause
    again = exact.make_requests(prompts, params, seeds=seeds)
    fed = 0
    while any(r.finish_reason is None for r in reqs + again):
        eng.run(reqs, keep=keys, max_steps=5)
        fed += exact.run(again, keep=keys, max_steps=5).fed_tokens
    assert [r.output_ids for r in reqs] == ref and [r.output_ids for r in again] == ref
    assert fed == sum(len(p) + len(o) - 1 for p, o in zip(prompts, ref))  # each context fed once


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_max_steps_must_be_a_count(hf, bad):
    eng = engine(hf, max_batch_size=2)
    reqs = eng.make_requests([[1, 2]], SamplingParams(max_tokens=4), seeds=[0])
    with pytest.raises(ValueError, match="max_steps"):
        eng.run(reqs, max_steps=bad)
    eng.run(reqs)
    assert len(reqs[0].output_ids) == 4


@pytest.mark.parametrize("keep,match", [(["a"], "one key"), ([["x"], None], "hashable"), (["a", "a"], "twice"),
                                        ("ab", "sequence")])
def test_bad_keys_are_rejected_and_the_engine_stays_usable(hf, keep, match):
    prompts, _, seeds, _ = workload(n=2, seed=13)
    params = SamplingParams(temperature=1.0, max_tokens=12)
    eng = engine(hf, max_batch_size=2, kept_slots=2)
    reqs = eng.make_requests(prompts, params, seeds=seeds)
    with pytest.raises(ValueError, match=match):
        eng.run(reqs, max_new_tokens=4, keep=keep)
    assert all(not r.output_ids for r in reqs) and eng.kept.keys() == []
    eng.run(reqs, keep=["a", "b"])
    assert [r.output_ids for r in reqs] == [o.token_ids for o in engine(hf, max_batch_size=2).generate(
        prompts, params, seeds=seeds)]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_kept_slots_must_be_a_count(bad):
    with pytest.raises(ValueError, match="kept_slots"):
        EngineConfig(kept_slots=bad).validate()
