"""The noise study's arms are the configs they claim to be, and its summary is arithmetic."""
from benchmarks.noise_study import ARMS, summarize
from rl_integration.config import load_config, validate


def test_arms_configure_what_they_name():
    cfgs = {arm: load_config(None, make(2)) for arm, make in ARMS.items()}
    for cfg in cfgs.values():
        validate(cfg)
    plain = cfgs["plain"].rollout
    assert plain.engine.spec is None and not plain.history.enabled and plain.noise == "per_step"
    assert plain.seed == 1002  # its own noise stream: not the per_step arm's draws replayed
    assert cfgs["per_sample"].rollout.noise == "per_sample" and cfgs["per_sample"].rollout.engine.spec is not None
    assert cfgs["per_step"].rollout.noise == "per_step" and cfgs["per_step"].rollout.engine.spec is not None
    assert cfgs["per_step"].rollout.seed is None  # trainer.seed, as the demo


def test_fresh_noise_is_the_default():
    from rl_integration.config import RolloutSection

    assert RolloutSection().noise == "per_step" == load_config(None, []).rollout.noise


def test_summary():
    s = summarize({"a": {0: [0.1, 0.2, 0.3, 0.4], 1: [0.3, 0.4, 0.5, 0.6]}})["a"]
    assert all(abs(a - b) < 1e-12 for a, b in zip(s["mean_curve"], [0.2, 0.3, 0.4, 0.5]))
    assert all(abs(a - b) < 1e-12 for a, b in zip(s["last3_per_seed"], [0.3, 0.5]))
    assert abs(s["last3_mean"] - 0.4) < 1e-12
    assert abs(s["first_step_mean"] - 0.2) < 1e-12


def test_fresh_noise_evaluation_joins_each_step_record(tiny_run, tmp_path):
    import json

    from benchmarks.noise_study import FreshNoiseEval
    from rl_integration.trainer import train

    cfg = load_config(None, tiny_run + ["trainer.steps=2", f"output.dir={tmp_path}", "output.plot=false"])
    evaluate = FreshNoiseEval(cfg)
    first = evaluate(0, evaluate.client.backend.engine.model)  # the same weights twice: same draws
    assert first == evaluate(0, evaluate.client.backend.engine.model)
    assert 0.0 <= first["eval_reward"] <= 1.0
    records = train(cfg, echo=lambda line: None, on_step_end=evaluate)
    evaluate.close()
    assert [set(r) >= {"eval_reward"} for r in records] == [True, True]
    logged = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["eval_reward"] for r in logged] == [r["eval_reward"] for r in records]
