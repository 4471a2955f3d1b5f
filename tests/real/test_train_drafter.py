"""`spectail train` on SmolLM2 with the drafter on (issue 47): step 0 used to crash at its end,
when the drafter's buffer refresh ran the model on a forward with no logit rows."""
from __future__ import annotations

import os

from rl_integration import cli
from rl_integration.dataset import write_rows
from rl_integration.metrics import read_jsonl

from .conftest import CHATS


def test_one_grpo_step_with_the_drafter_on_a_real_checkpoint(smollm2, tmp_path, capsys):
    data = tmp_path / "train.parquet"
    write_rows([{"prompt": c, "answer": "x"} for c in CHATS[:2]], data)
    out = tmp_path / "out"
    rc = cli.main(["train", "--config", os.path.join(os.path.dirname(__file__), "..", "..", "examples",
                                                      "grpo_parquet.yaml"),
                   "policy.source=checkpoint", f"policy.checkpoint={smollm2}", f"task.parquet.path={data}",
                   "trainer.prompts_per_step=2", "rollout.n=2", "rollout.max_tokens=8", "trainer.steps=1",
                   "rollout.drafter.enabled=true", "rollout.drafter.between_steps_s=1", "output.plot=false",
                   "--out", str(out), "--quiet"])
    assert rc == 0, capsys.readouterr().err
    (record,) = read_jsonl(out / "metrics.jsonl")
    assert record["num_samples"] == 4 and record["drafter_train_steps"] >= 1
