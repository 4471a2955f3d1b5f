"""RolloutClient on a tiny random model: groups and seeds, history reuse, exactness against the
plain engine, metrics names, weight updates and bad input."""
from __future__ import annotations

import math
import os

import pytest
import torch

from rl_integration.config import RolloutSection, RunConfig, demo_engine
from rl_integration.rollout_client import RolloutClient
from rollout import EngineConfig, SpecConfig
from rollout.core.seeds import prompt_key, sample_seed
from scheduler.history_store import HistoryStore
from tests.conftest import tiny_hf_model

PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10], [1, 11, 12, 13]]
METRIC_NAMES = ("rollout_seconds", "generated_tokens", "tokens_per_second", "forward_passes",
                "accepted_per_verify", "proposed", "accepted", "reused_tokens", "spec_off_fraction",
                "tail_seconds", "worker_busy_fraction", "drafter_train_steps", "drafter_version", "reward_mean",
                "history_found")

def lookup(store, prompt_ids, sample_index, before_step=None):
    """The store's newest record for one (prompt, sample index)."""
    return store.records_for([prompt_ids], [sample_index], before_step)[0]



@pytest.fixture(scope="module")
def model():
    return tiny_hf_model("llama", seed=3)


def section(spec="demo", max_batch_size=16, **kw):
    spec = demo_engine().spec if spec == "demo" else spec
    base = dict(max_tokens=12, n=3, noise="per_sample",
                engine=EngineConfig(max_batch_size=max_batch_size, max_model_len=64, spec=spec))
    base.update(kw)
    return RolloutSection(**base)


def test_groups_seeds_and_noise_modes(model, tmp_path):
    client = RolloutClient(section(), model, seed=7, stop_token_ids=[2], history_dir=tmp_path)
    b0 = client.generate(PROMPTS)
    assert len(b0) == 9 and b0.n == 3 and b0.num_prompts == 3 and b0.step == 0
    assert b0.group_index == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert b0.sample_index == [0, 1, 2] * 3
    assert b0.prompt_ids == [p for p in PROMPTS for _ in range(3)]
    assert len(set(b0.seeds)) == 9 and all(0 <= s < 2**63 for s in b0.seeds)
    assert b0.seeds[4] == sample_seed(7, prompt_key(PROMPTS[1]), 1)
    for ids, lps, reason in zip(b0.completion_ids, b0.logprobs, b0.finish_reasons):
        assert len(ids) == len(lps) >= 1 and all(lp <= 0 for lp in lps)
        assert reason in ("stop", "length")
    client.end_step()
    b1 = client.generate(PROMPTS, n=2)
    assert b1.step == 1 and b1.seeds == [s for i, s in enumerate(b0.seeds) if i % 3 < 2]  # per_sample
    # per_step: the step enters the hash, so seeds change between steps
    pe = RolloutClient(section(noise="per_step", spec=None), model, seed=7, stop_token_ids=[2])
    s0 = pe.generate(PROMPTS, step=0).seeds
    s1 = pe.generate(PROMPTS, step=1).seeds
    assert s0 != s1 and len(set(s0) & set(s1)) == 0
    assert pe.generate(PROMPTS, step=1).seeds == s1
    # caller-given identities: equal keys give equal seeds, whatever the prompt; a key repeated in
    # one call is a second group of the same prompt, whose samples go on numbering (other noise)
    ka, kb = pe.generate(PROMPTS[:1], keys=["same"]), pe.generate(PROMPTS[1:2], keys=["same"])
    assert ka.seeds == kb.seeds
    kk = pe.generate(PROMPTS[:2], keys=["same", "same"])
    assert kk.seeds[:3] == ka.seeds and kk.sample_index == [0, 1, 2, 3, 4, 5] and not set(kk.seeds[3:]) & set(ka.seeds)


def test_history_reuse_is_exact_and_reuses_tokens(model, tmp_path):
    torch.manual_seed(0)
    local = tiny_hf_model("llama", seed=3)
    # a fixed threshold: the priced default reads wall-clock step costs, so how much it drafts (and
    # so how many tokens it reuses) would move with the machine's load
    spec = section(spec=SpecConfig(proposers=("history", "suffix", "ngram"), max_draft_tokens=6,
                                   min_draft_prob=0.0))
    client = RolloutClient(spec, local, seed=1, stop_token_ids=[2], history_dir=tmp_path / "hist")
    plain = RolloutClient(spec, local, seed=1, stop_token_ids=[2], plain=True)
    assert plain.history is None and plain.engine_config.spec is None
    reused, found = [], []
    for step in range(3):
        b = client.generate(PROMPTS, step=step)
        p = plain.generate(PROMPTS, step=step)
        assert b.seeds == p.seeds
        assert b.completion_ids == p.completion_ids  # speculation never changes a token
        for x, y in zip(b.logprobs, p.logprobs):
            assert max(abs(u - v) for u, v in zip(x, y)) < 1e-4
        client.record_rewards(b, [float(i % 2) for i in range(len(b))])
        m = client.end_step()
        assert m["step"] == step
        plain.end_step()
        reused.append(m["reused_tokens"])
        found.append(m["history_found"])
        if step == 1:  # the policy moves a little: history still drafts, tokens still exact
            with torch.no_grad():
                for prm in local.parameters():
                    prm.add_(torch.randn_like(prm) * 0.02)
            client.update_weights(local)
            plain.update_weights(local)
    assert reused[0] == 0 and found == [0, len(b), len(b)]
    generated = sum(len(c) for c in b.completion_ids)
    assert reused[1] >= 0.8 * (generated - len(b))  # same weights, same noise: nearly all reused
    store = HistoryStore(tmp_path / "hist")
    assert store.steps() == [2]  # every record of steps 0 and 1 has a newer one
    rec = lookup(store, PROMPTS[2], 1)
    assert rec.step == 2 and rec.reward == float((2 * 3 + 1) % 2) and rec.seed == b.seeds[7]
    assert rec.token_ids == b.completion_ids[7]


def test_metrics_have_the_design_names(model, tmp_path):
    # 4 slots for 9 requests: steps with 4 running are compute-bound (> 3), the last one is not
    client = RolloutClient(section(max_batch_size=4, spec=SpecConfig(proposers=("ngram",), max_batch_for_spec=3)),
                           model, seed=0, stop_token_ids=[2])
    b = client.generate(PROMPTS)
    for name in METRIC_NAMES:
        assert name in b.step_stats, name
    assert b.step_stats["reward_mean"] is None
    client.record_rewards(b, [1.0] * 3 + [0.0] * 6)
    m = client.step_metrics()
    for name in METRIC_NAMES:
        assert name in m, name
    assert m["reward_mean"] == pytest.approx(1 / 3)
    assert m["generated_tokens"] == sum(len(c) for c in b.completion_ids)
    assert m["tokens_per_second"] == pytest.approx(m["generated_tokens"] / m["rollout_seconds"])
    assert m["worker_busy_fraction"] == 1.0 and m["drafter_version"] == 0
    assert 0.0 < m["spec_off_fraction"] < 1.0
    assert m["accepted_per_verify"] >= 1.0
    plain = RolloutClient(section(spec=None), model, seed=0, stop_token_ids=[2])
    pm = plain.generate(PROMPTS).step_stats
    assert pm["accepted_per_verify"] == pytest.approx(1.0) and pm["spec_off_fraction"] == 1.0


def test_update_weights_changes_samples(tmp_path):
    local = tiny_hf_model("llama", seed=4)
    client = RolloutClient(section(spec=None), local, seed=0, stop_token_ids=[2])
    before = client.generate(PROMPTS).completion_ids
    assert client.generate(PROMPTS).completion_ids == before  # same weights and seeds: same tokens
    other = tiny_hf_model("llama", seed=5)
    client.update_weights(other)
    assert client.generate(PROMPTS).completion_ids != before
    bad = {k: v for k, v in other.state_dict().items()}
    bad["model.norm.weight"] = torch.full_like(bad["model.norm.weight"], math.nan)
    with pytest.raises(ValueError, match="NaN"):
        client.update_weights(bad)


def test_bad_input(model, tmp_path):
    client = RolloutClient(section(), model, seed=0, stop_token_ids=[2], history_dir=tmp_path)
    for n in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="n \\(samples per prompt\\) must be an integer >= 1"):
            client.generate(PROMPTS, n=n)
    with pytest.raises(ValueError, match="at least one prompt"):
        client.generate([])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        client.generate([[1, 5000]])
    with pytest.raises(ValueError, match="keys has 1 entries for 3 prompts"):
        client.generate(PROMPTS, keys=["a"])
    b = client.generate(PROMPTS)
    with pytest.raises(ValueError, match="got 2 rewards for 9 samples"):
        client.record_rewards(b, [1.0, 0.0])
    with pytest.raises(ValueError, match="reward of sample 4 must be a finite number"):
        client.record_rewards(b, [0.0] * 4 + [math.nan] + [0.0] * 4)
    client.end_step()
    with pytest.raises(ValueError, match="before the client's current step"):
        client.generate(PROMPTS, step=0)
    with pytest.raises(ValueError, match="step must be an integer"):
        client.generate(PROMPTS, step=1.5)
    with pytest.raises(ValueError, match="history_dir"):
        RolloutClient(section(), model, stop_token_ids=[2])
    # a whole RunConfig works too: the history goes under output.dir
    run = RunConfig()
    run.rollout = section()
    run.output.dir = str(tmp_path / "out")
    c = RolloutClient(run, model)
    assert c.history.root == tmp_path / "out" / "history" and c.params.stop_token_ids == (model.config.eos_token_id,)
    assert not os.path.exists(tmp_path / "out")  # nothing is written before a step ends
