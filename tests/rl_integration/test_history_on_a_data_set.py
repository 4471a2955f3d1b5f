"""History reuse on a data set larger than one step's prompts, with the default settings: a
prompt comes back once per epoch (every len(data) / prompts_per_step steps), and its newest
response is still there to draft from."""
from __future__ import annotations

import dataclasses

from rl_integration.config import load_config
from rl_integration.dataset import save_parquet_dataset
from rl_integration.demo.task import make_problems
from rl_integration.trainer import train


def test_a_data_set_four_steps_long_reuses_history_from_its_second_pass(tiny_run, tmp_path):
    task = load_config(None, tiny_run).task.embedded
    data = tmp_path / "train.parquet"
    save_parquet_dataset(make_problems(dataclasses.replace(task, num_problems=32, seed=11)), data)
    # The drafter off: it would take the drafts whose reuse is checked below. A fixed draft
    # threshold: the priced budget weighs drafts by measured step times, and on this policy, whose
    # step takes about a millisecond, whether history's drafts or the suffix proposer's copies of
    # the same text win a step is timing noise; what is checked here is that history is found
    # and reused, not which proposer a timing favours.
    cfg = load_config(None, tiny_run + ["task.source=parquet", f"task.parquet.path={data}", "trainer.steps=6",
                                        "trainer.prompts_per_step=8", f"output.dir={tmp_path / 'run'}",
                                        "output.plot=false", "rollout.drafter.enabled=false",
                                        "rollout.engine.spec.min_draft_prob=0.3"])
    assert cfg.rollout.history == type(cfg.rollout.history)()  # the defaults
    records = train(cfg, echo=lambda line: None)
    assert [r["epoch"] for r in records] == [0, 0, 0, 0, 1, 1]
    assert records[0]["history_found"] == 0 and records[0]["reused_tokens"] == 0
    for r in records[4:]:  # the second pass: every request finds its sample's response of 4 steps ago
        assert r["num_requests"] == 64 and r["history_found"] == 64, r
        assert r["reused_tokens"] > 0, r
