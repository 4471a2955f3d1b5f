"""Online training on what the engine ran: the buffer's features refreshed under new weights,
bounded by time and passes, a new head version; the
run config turns the drafter on with its first head."""
import dataclasses
import random

import pytest
import torch

from drafter.head import DraftHead, HeadConfig
from drafter.online import OnlineConfig, OnlineState, measure, train_on_buffer
from drafter.proposer import DrafterProposer
from rollout import Engine, EngineConfig, SamplingParams, SpecConfig
from rollout.config import DrafterSpec
from tests.drafter.conftest import VOCAB, sharp_policy


def run_engine(policy, head=None, n=16, seed=0, **spec_kw):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 6))] for _ in range(n)]
    spec = SpecConfig(proposers=("drafter",), max_draft_tokens=4, min_draft_prob=0.0, drafter=DrafterSpec(**spec_kw))
    eng = Engine(policy, EngineConfig(max_batch_size=8, max_model_len=96, spec=spec))
    dp = DrafterProposer.of(eng)
    if head is not None:
        dp.set_head(head, 1)
    outs = eng.generate(prompts, SamplingParams(temperature=1.0, max_tokens=30), seeds=list(range(seed, seed + n)))
    return eng, dp, outs


def test_training_on_the_buffer_raises_acceptance_and_makes_a_version():
    policy = sharp_policy()  # its own: the weights change below
    head = DraftHead.for_policy(policy, HeadConfig(window=16), dtype=torch.float32, seed=2)
    eng, dp, _ = run_engine(policy, head)
    before = measure(dp)
    assert before["drafter_sim_samples"] == 16 and 0 <= before["drafter_sim_acceptance"] < 0.9
    online = OnlineState()
    out = train_on_buffer(dp, online, OnlineConfig(DrafterSpec(lr=3e-3), max_passes=40.0), budget_s=30.0)
    assert out["drafter_train_steps"] > 5 and out["drafter_version"] == 2 and dp.head is head
    assert measure(dp)["drafter_sim_acceptance"] > before["drafter_sim_acceptance"] + 0.05
    # new weights: the next call recomputes the features it uses (lazily), current_only skips them
    eng.update_weights({"model.layers.0.mlp.up_proj.weight": policy.model.layers[0].mlp.up_proj.weight * 1.1})
    assert train_on_buffer(dp, online, OnlineConfig(), 5.0, current_only=True)["drafter_train_steps"] == 0
    out = train_on_buffer(dp, online, OnlineConfig(max_passes=1.0), 30.0)
    assert out["drafter_refreshed_tokens"] > 0 and out["drafter_train_steps"] >= 1 and dp.head_version == 3


def test_with_no_head_the_first_training_makes_one(policy):
    eng, dp, _ = run_engine(policy, head=None, kind="mlp")
    assert dp.head is None and len(dp.buffer) == 16  # collected without drafting
    train_on_buffer(dp, OnlineState(), OnlineConfig(DrafterSpec(kind="mlp")), budget_s=10.0)
    assert dp.head is not None and dp.head.kind == "mlp" and dp.head_version == 1


def test_the_run_config_turns_the_drafter_on(tmp_path, policy):
    from drafter.export import export
    from rl_integration.config import load_config
    from rl_integration.online_drafter import start

    head = DraftHead.for_policy(policy, HeadConfig(), seed=1)
    export(head, tmp_path / "head")
    cfg = load_config(None, ["policy.source=checkpoint", f"policy.checkpoint={tmp_path}",
                             "rollout.drafter.enabled=true", f"rollout.drafter.path={tmp_path / 'head'}",
                             "rollout.drafter.idle_slice_s=0.5", "rollout.drafter.lr=0.002"])
    drafter = start(cfg, None, progress=False)
    spec = cfg.rollout.engine.spec
    assert drafter is not None and spec.proposers[-1] == "drafter" and spec.drafter.path == str(tmp_path / "head")
    # the engine's DrafterSpec is rollout.drafter, with its first head's path: what Ray workers read
    assert spec.drafter == dataclasses.replace(cfg.rollout.drafter, path=str(tmp_path / "head"))
    assert (spec.drafter.idle_slice_s, spec.drafter.lr, spec.drafter.window) == (0.5, 0.002, 64)
    off = load_config(None, [])  # off by default
    assert start(off, None) is None and "drafter" not in off.rollout.engine.spec.proposers
    with pytest.raises(ValueError, match="'rollout.drafter.lr' must be > 0"):
        load_config(None, ["rollout.drafter.lr=0"])
    with pytest.raises(ValueError, match="'rollout.drafter.buffer_tokens' must be an integer >= 1"):
        load_config(None, ["rollout.drafter.buffer_tokens=0"])


def test_a_fresh_head_on_a_ray_worker_has_the_configured_layer(tmp_path):
    """The spot trainer's code path (scheduler.worker.RolloutWorker.train_drafter, as a Ray actor
    runs it) makes a fresh head of the DrafterSpec's layer sizes, not the policy's."""
    from drafter.export import from_state
    from scheduler.worker import RolloutWorker
    from tests.conftest import tiny_hf_model

    tiny_hf_model("llama", vocab=VOCAB, seed=5).save_pretrained(tmp_path / "policy")  # 48 wide, 96 / 4 / 2
    layer = dict(intermediate_size=24, num_heads=2, num_kv_heads=1)
    spec = SpecConfig(proposers=("drafter",), max_draft_tokens=4,
                      drafter=DrafterSpec(kind="attention", window=8, idle_slice_s=0.5, **layer))
    worker = RolloutWorker(str(tmp_path / "policy"), EngineConfig(max_batch_size=4, max_model_len=64, spec=spec))
    worker.engine.generate([[5, 6, 7], [9, 8]], SamplingParams(temperature=1.0, max_tokens=16), seeds=[1, 2])
    out = worker.train_drafter(10.0)
    assert out["steps"] >= 1 and out["version"] == 1
    assert {k: out["state"]["head"][k] for k in layer} == layer and out["state"]["head"]["window"] == 8
    head = from_state(out["state"], worker.engine.model)  # what the other workers load
    layer0 = head.layers[0]
    assert (layer0.self_attn.k_proj.out_features, layer0.mlp.up_proj.out_features) == (12, 24)  # 1 kv head of 12


def test_the_drafter_spec_checks_its_layer_sizes():
    for name, bad in (("intermediate_size", 0), ("num_heads", True), ("num_kv_heads", 1.5)):
        with pytest.raises(ValueError, match=f"DrafterSpec.{name} must be None"):
            DrafterSpec(**{name: bad}).validate()
    with pytest.raises(ValueError, match=r"DrafterSpec.num_heads must be a multiple of num_kv_heads \(2\), got 3"):
        DrafterSpec(num_heads=3, num_kv_heads=2).validate()
    with pytest.raises(ValueError, match="'rollout.drafter.num_heads' must be None"):
        from rl_integration.config import load_config
        load_config(None, ["rollout.drafter.num_heads=0"])
    DrafterSpec(intermediate_size=8, num_heads=4, num_kv_heads=2).validate()
