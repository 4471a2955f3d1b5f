"""A run on a checkpoint policy with the drafter on starts from a head warm-started on the policy's
own samples of the task's prompts (drafter/checkpoint_warm_start.py), cached under the spectail
cache (policy.cache_dir here), never in the checkpoint's folder, and found there by the next run."""
from __future__ import annotations

import os

from drafter.export import load
from rl_integration import online_drafter
from rl_integration.config import load_config
from rl_integration.dataset import encode_prompts
from rl_integration.trainer import load_policy, load_problems
from rollout.core.model import CausalLM


def test_a_checkpoint_policy_gets_a_cached_warm_started_head(tiny_run, tmp_path):
    model, tok, folder = load_policy(load_config(None, tiny_run), progress=False)
    before = sorted(os.listdir(folder))
    overrides = tiny_run + ["policy.source=checkpoint", f"policy.checkpoint={folder}", "rollout.drafter.enabled=true",
                            "rollout.drafter.warm_start_s=4", "rollout.drafter.draft_vocab=20",
                            f"policy.cache_dir={tmp_path / 'cache'}"]
    cfg = load_config(None, overrides)
    prompts = encode_prompts(tok, load_problems(cfg))
    assert online_drafter.start(cfg, folder, progress=False, prompts=prompts, stop_token_ids=[tok.eos_token_id])
    assert cfg.rollout.engine.spec.drafter.path is not None
    path = cfg.rollout.engine.spec.drafter.path
    assert path is not None and os.path.dirname(path) == str(tmp_path / "cache")
    assert sorted(os.listdir(folder)) == before  # nothing written beside the user's checkpoint
    head = load(path, CausalLM.from_pretrained(model))
    assert head.cfg.draft_vocab == 20 and head.cfg.window == cfg.rollout.drafter.window
    mtime = os.path.getmtime(os.path.join(path, "model.safetensors"))
    again = load_config(None, overrides)
    online_drafter.start(again, folder, progress=False, prompts=prompts, stop_token_ids=[tok.eos_token_id])
    assert again.rollout.engine.spec.drafter.path == path
    assert os.path.getmtime(os.path.join(path, "model.safetensors")) == mtime  # loaded, not trained again
