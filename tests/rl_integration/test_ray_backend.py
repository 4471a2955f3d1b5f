"""The Ray backend behind RolloutClient: a run on two local Ray workers gives the in-process run."""
from __future__ import annotations

import pytest

from rl_integration import cli
from rl_integration.metrics import read_jsonl


# bfloat16: the workers' processes compute through the same CPU kernels (AMX tiles where there are)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ray_backend_gives_the_local_run(tiny_run, tmp_path, capsys, dtype):
    pytest.importorskip("ray")
    runs = {}
    for backend in ("local", "ray"):
        out = tmp_path / backend
        rc = cli.main(["demo", *tiny_run, f"rollout.backend={backend}", "rollout.num_workers=2", "trainer.steps=2",
                       f"rollout.engine.dtype={dtype}", "--no-compare", "output.plot=false", "--out", str(out)])
        assert rc == 0, capsys.readouterr().err
        runs[backend] = read_jsonl(out / "metrics.jsonl")
    for a, b in zip(runs["local"], runs["ray"]):  # same weights, seeds and updates: the same samples
        assert (a["generated_tokens"], a["reward_mean"]) == (b["generated_tokens"], b["reward_mean"])
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)  # logprobs agree to float rounding
    assert runs["ray"][1]["reused_tokens"] > 0  # history drafts reach the workers


def test_a_ray_run_checkpoints_its_published_head_and_a_resume_restores_it(tiny_run, tmp_path, capsys):
    """The head that idle slices trained on the workers is saved with its version; a resumed run
    publishes it, so each worker drafts with exactly it (same weights, same version) from its
    first chunk on, and a checkpoint of the resumed run saves it back unchanged."""
    ray = pytest.importorskip("ray")
    import torch

    from drafter.export import read_state
    from rl_integration import checkpoint as C
    from rl_integration import online_drafter, resume
    from rl_integration.config import load_config
    from rl_integration.rollout_client import RolloutClient

    from .test_resume import DEMO, SMALL

    out = tmp_path / "run"
    run = [*tiny_run, *SMALL, "rollout.drafter.enabled=true", "rollout.backend=ray", "rollout.num_workers=2",
           "rollout.drafter.idle_slice_s=0.2"]
    assert cli.main(["train", "--config", DEMO, *run, "trainer.steps=1", "--out", str(out)]) == 0, \
        capsys.readouterr().err
    ckpt = C.load_checkpoint(out / "checkpoints" / "step-1")
    state, version = read_state(ckpt.drafter)
    # the newest published version (the save waits for a slice still in flight at the end of the
    # rollout), or the warm start's (0) where no slice trained in so short a rollout; that slices
    # publish, and that published_drafter returns it, is tests/scheduler/test_drafter_ray.py's
    assert version >= ckpt.metrics[0]["drafter_version"] >= 0

    cfg = load_config(DEMO, [*run, "trainer.steps=2", f"output.dir={out}"])
    ckpt = resume.find(cfg, "auto")
    model, tokenizer = ckpt.load_model(), ckpt.load_tokenizer()
    saved = resume.saved_drafter(ckpt, cfg, model)
    assert saved is not None and saved[0] == version
    drafter = online_drafter.start(cfg, None, progress=False)
    client = RolloutClient(cfg, model, stop_token_ids=[tokenizer.eos_token_id])
    try:
        online_drafter.restore(drafter, client, saved)
        client.backend.idle_training_s = None  # no slices: nothing may move the restored head
        prompts = [tokenizer(f"{a} + {a} =")["input_ids"] for a in range(4)]
        client.generate(prompts, step=1)
        info = [ray.get(a.ping.remote(), timeout=30) for a in client.backend.workers.values()]
        assert all(i["drafter_version"] == version and not i["drafter_off"] for i in info), info
        assert client.backend.metrics()["drafter_seconds"] > 0
        back_version, back = online_drafter.latest_head(drafter, client)
        assert back_version == version and back["head"] == state["head"]
        assert all(torch.equal(back["weights"][k], state["weights"][k]) for k in state["weights"])
    finally:
        client.shutdown()
