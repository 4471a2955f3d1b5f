"""Run configs: YAML + dotted overrides; unknown keys and wrong types fail early, by name."""
from __future__ import annotations

import dataclasses
import os

import pytest

from rl_integration.config import RunConfig, demo_engine, load_config
from rl_integration.config_loader import apply_override, to_dict

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")


def test_demo_yaml_is_the_code_default():
    # `spectail demo` runs RunConfig(); examples/demo.yaml must say the same thing
    assert load_config(os.path.join(EXAMPLES, "demo.yaml")) == RunConfig()
    assert load_config(None) == RunConfig()


@pytest.mark.parametrize("name", ["demo.yaml", "grpo_parquet.yaml", "ppo.yaml", "grpo_ray.yaml", "grpo_verl.yaml"])
def test_examples_load(name):
    cfg = load_config(os.path.join(EXAMPLES, name))
    assert isinstance(cfg, RunConfig)


def test_overrides_nested_and_typed():
    cfg = load_config(None, ["trainer.steps=3", "rollout.engine.spec.max_draft_tokens=16", "trainer.lr=3e-4",
                             "rollout.engine.spec.proposers=[ngram]", "output.dir=somewhere",
                             "trainer.clip_eps_high=0.28"])
    assert cfg.trainer.steps == 3 and cfg.rollout.engine.spec.max_draft_tokens == 16
    assert cfg.trainer.lr == pytest.approx(3e-4) and isinstance(cfg.trainer.lr, float)
    assert cfg.rollout.engine.spec.proposers == ("ngram",) and cfg.output.dir == "somewhere"
    assert cfg.rollout.engine.spec.max_draft_tokens == 16 and cfg.rollout.engine.max_batch_size == 64  # merged
    assert cfg.trainer.clip_eps_high == pytest.approx(0.28)
    # null turns a section off; setting one of its keys brings it back with defaults
    assert load_config(None, ["rollout.engine.spec=null"]).rollout.engine.spec is None
    back = load_config(None, ["rollout.engine.spec=null", "rollout.engine.spec.max_draft_tokens=4"]).rollout.engine.spec
    assert back == dataclasses.replace(demo_engine().spec, max_draft_tokens=4)
    # one key of a section keeps the section's other defaults (the demo's, not the class's)
    kept = load_config(None, ["rollout.engine.spec.max_draft_tokens=4"]).rollout.engine.spec
    assert kept.proposers == demo_engine().spec.proposers and kept.max_draft_tokens == 4
    # ints are accepted where a float is expected, and round-trip through to_dict
    assert load_config(None, ["trainer.lr=1"]).trainer.lr == 1.0
    cfg = load_config(None, ["trainer.algorithm=ppo", "trainer.ppo.lam=0.9"])
    raw = to_dict(cfg)
    assert raw["trainer"]["ppo"]["lam"] == 0.9 and raw["trainer"]["algorithm"] == "ppo"


def test_yaml_file_with_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  steps: 2\n  lr: 1.0e-3\nrollout:\n  engine: {spec: null}\n  n: 4\n")
    cfg = load_config(path, ["rollout.n=2"])
    assert (cfg.trainer.steps, cfg.trainer.lr, cfg.rollout.engine.spec, cfg.rollout.n) == (2, 1e-3, None, 2)


@pytest.mark.parametrize("override, words", [
    ("trainer.step=3", ["unknown config key 'trainer.step'", "did you mean 'steps'"]),
    ("trainer.epochs=3", ["'trainer.epochs' was renamed 'trainer.steps'", "pass over the data set"]),
    ("trainer.prompts_per_epoch=3", ["'trainer.prompts_per_epoch' was renamed 'trainer.prompts_per_step'"]),
    ("rollout.noise=per_epoch", ["'rollout.noise'", "'per_epoch' was renamed 'per_step'"]),
    ("rollout.history.keep_epochs=2", ["'rollout.history.keep_epochs' was renamed 'rollout.history.max_age_steps'",
                                       "max_bytes"]),
    ("rollout.history.max_age_steps=0", ["'rollout.history.max_age_steps'", ">= 1 or null"]),
    ("rollout.history.max_bytes=-1", ["'rollout.history.max_bytes'", ">= 0"]),
    ("rollout.kept_slots=-1", ["'rollout.kept_slots'", ">= 0 or null"]),
    ("rollout.engine.spec.max_draft=3", ["unknown config key 'rollout.engine.spec.max_draft'"]),
    ("nonsense.key=1", ["unknown config key 'nonsense'"]),
    ("trainer.steps=three", ["'trainer.steps'", "expected int", "'three'"]),
    ("trainer.steps=2.5", ["'trainer.steps'", "expected int"]),
    ("rollout.temperature=true", ["'rollout.temperature'", "expected float", "bool"]),
    ("rollout.noise=sometimes", ["'rollout.noise'", "per_sample", "per_step"]),
    ("rollout.engine.spec.proposers=ngram", ["'rollout.engine.spec.proposers'", "a list of str"]),
    ("rollout.engine.spec.proposers=[ngram, 3]", ["'rollout.engine.spec.proposers[1]'", "expected str"]),
    ("rollout.engine.max_batch_size=0", ["'rollout.engine'", "max_batch_size", ">= 1"]),
    ("rollout.engine.dtype=float8", ["'rollout.engine'", "dtype", "float8"]),
    ("trainer=5", ["'trainer'", "mapping"]),
    ("rollout.n=0", ["'rollout.n'", ">= 1"]),
    ("rollout.engine.spec.proposers=[magic]", ["'rollout.engine'", "unknown ['magic']"]),
    ("rollout.engine.spec.lenience=0.5", ["'rollout.engine'", "lenience", ">= 1"]),
    ("task.embedded.min_terms=1", ["task.embedded", "min_terms"]),
    ("rollout.drafter.train.lr=0.01", ["'rollout.drafter.train' is gone", "under 'rollout.drafter'",
                                       "rollout.drafter.train.lr is now rollout.drafter.lr"]),
    ("rollout.engine.spec.drafter.buffer_tokens=5", ["'rollout.engine.spec.drafter' is gone",
                                                     "rollout.drafter.buffer_tokens"]),
    ("rollout.drafter.idle_slice_s=0", ["'rollout.drafter.idle_slice_s'", "None (no slices) or > 0"]),
    ("rollout.drafter.kind=conv", ["'rollout.drafter.kind'", "'attention' or 'mlp'"]),
    ("rollout.engine.spec.proposers=[history, drafter]", ["'rollout.engine.spec.proposers'",
                                                          "rollout.drafter.enabled=true"]),
    ("trainer.steps", ["section.key=value"]),
])
def test_bad_keys_and_values_are_named(override, words):
    with pytest.raises(ValueError) as err:
        load_config(None, [override])
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_lenience_needs_history_drafts():
    assert load_config(None, ["rollout.engine.spec.lenience=2"]).rollout.engine.spec.lenience == 2.0
    with pytest.raises(ValueError, match="'rollout.engine.spec.lenience'.*history proposer"):
        load_config(None, ["rollout.engine.spec.lenience=2", "rollout.engine.spec.proposers=[suffix]"])
    with pytest.raises(ValueError, match="'rollout.engine.spec.lenience'.*history.enabled"):
        load_config(None, ["rollout.engine.spec.lenience=2", "rollout.history.enabled=false"])


def test_bad_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [1, 2\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="mapping"):
        load_config(listy)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("rollout:\n  histroy:\n    enabled: false\n")
    with pytest.raises(ValueError, match="'rollout.histroy'.*did you mean 'history'"):
        load_config(unknown)


def test_apply_override_rejects_non_sections():
    raw = {"trainer": {"steps": 3}}
    with pytest.raises(ValueError, match="trainer.steps is not a section"):
        apply_override(raw, "trainer.steps.x=1")


def test_rollout_kept_slots_reaches_the_ray_backend(monkeypatch):
    import scheduler.ray_backend
    from rl_integration.rollout_client import build_backend

    built = []
    monkeypatch.setattr(scheduler.ray_backend, "RayRolloutBackend", lambda *a, **kw: built.append(kw))
    for value, expected in (("0", 0), ("null", None)):  # 0: none kept; null: the backend's default
        cfg = load_config(None, ["rollout.backend=ray", f"rollout.kept_slots={value}"])
        build_backend(cfg.rollout, None, cfg.rollout.engine)
        assert built.pop().get("kept_slots") == expected


def test_a_checkpoint_saved_before_the_one_drafter_section_still_loads():
    """run.yaml of older checkpoints split the drafter over rollout.drafter.train and
    rollout.engine.spec.drafter: resume reads it as rollout.drafter."""
    from rl_integration.config import upgrade_saved
    from rl_integration.config_loader import from_dict

    raw = to_dict(RunConfig())
    d = raw["rollout"]["drafter"]
    d["train"] = {k: d.pop(k) for k in ("between_steps_s", "idle_slice_s", "lr", "ttt_steps", "reward_beta")}
    d["train"]["lr"] = 0.002
    del d["collect"], d["buffer_tokens"]  # then only in rollout.engine.spec.drafter
    raw["rollout"]["engine"]["spec"]["drafter"] = {
        "path": None, "collect": True, "buffer_tokens": 1000, "max_positions": None, "kind": "attention",
        "window": None, "idle_slice_s": None, "lr": 1e-3, "ttt_steps": 3, "intermediate_size": None,
        "num_heads": None, "num_kv_heads": None}
    with pytest.raises(ValueError, match="is gone: its keys are set under 'rollout.drafter'"):
        from_dict(RunConfig, raw)
    cfg = from_dict(RunConfig, upgrade_saved(raw))
    assert "train" in raw["rollout"]["drafter"]  # the checkpoint's own mapping is left as it was
    assert cfg.rollout.drafter == dataclasses.replace(RunConfig().rollout.drafter, lr=0.002, buffer_tokens=1000)
    assert cfg.rollout.engine == RunConfig().rollout.engine
    assert upgrade_saved(to_dict(RunConfig())) == to_dict(RunConfig())  # a new run.yaml is left as it is
