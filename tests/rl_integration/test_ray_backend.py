"""The Ray backend behind RolloutClient: a run on two local Ray workers gives the in-process run."""
from __future__ import annotations

import pytest

from rl_integration import cli
from rl_integration.metrics import read_jsonl


def test_ray_backend_gives_the_local_run(tiny_run, tmp_path, capsys):
    pytest.importorskip("ray")
    runs = {}
    for backend in ("local", "ray"):
        out = tmp_path / backend
        rc = cli.main(["demo", *tiny_run, f"rollout.backend={backend}", "rollout.num_workers=2", "trainer.steps=2",
                       "--no-compare", "output.plot=false", "--out", str(out)])
        assert rc == 0, capsys.readouterr().err
        runs[backend] = read_jsonl(out / "metrics.jsonl")
    for a, b in zip(runs["local"], runs["ray"]):  # same weights, seeds and updates: the same samples
        assert (a["generated_tokens"], a["reward_mean"]) == (b["generated_tokens"], b["reward_mean"])
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)  # logprobs agree to float rounding
    assert runs["ray"][1]["reused_tokens"] > 0  # history drafts reach the workers
