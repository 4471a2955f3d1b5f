"""spectail inside TRL's GRPOTrainer (rl_integration/trl_rollout.py), driven by examples/trl_grpo.py
on the tiny policy: the rollouts' logprobs are the policy's own after every weight sync, reward
rises, the per-step metrics are printed; bad settings are refused before any rollout."""
from __future__ import annotations

import copy
import os
import types

import pytest
import torch

trl = pytest.importorskip("trl", reason="trl is not installed (pip install 'spectail[trl]')")

from rl_integration.trl_gather import gather_generate_scatter  # noqa: E402
from rl_integration.trl_rollout import SpectailRollout, group_prompts  # noqa: E402
from rl_integration.trl_weights import check_mergeable, policy_weights, unwrap  # noqa: E402
from rollout.core.seeds import prompt_key, sample_seed  # noqa: E402
from tests.rl_integration.conftest import load_example  # noqa: E402

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


@pytest.fixture(scope="module")
def example():
    return load_example("trl_grpo.py")


def example_args(example, tiny_run, out, steps: int, seed: int = 0):
    demo = [o for o in tiny_run if o.startswith(("task.", "policy."))]
    return example.parse_args(["--steps", str(steps), "--max-completion-length", "24", "--seed", str(seed),
                               "--output-dir", str(out), "--set", *demo])


@pytest.fixture(scope="module")
def trainer(example, tiny_run, tmp_path_factory):
    return example.build_trainer(example_args(example, tiny_run, tmp_path_factory.mktemp("trl"), steps=1))


@torch.no_grad()
def logprob_gap(model, out: dict, temperature: float) -> float:
    """Largest |engine logprob - log_softmax(plain forward / T)| over every completion token
    (one right-padded batch: padding after a sequence does not change its causal logits)."""
    was_training = model.training
    model.eval()
    rows = [p + c for p, c in zip(out["prompt_ids"], out["completion_ids"])]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    logits = model(input_ids=ids, attention_mask=mask).logits.float() / temperature
    logps = torch.log_softmax(logits, -1)
    model.train(was_training)
    gap = 0.0
    for i, (prompt, completion, lps) in enumerate(zip(out["prompt_ids"], out["completion_ids"], out["logprobs"])):
        at = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(completion))
        ref = logps[i, at, torch.tensor(completion)]
        gap = max(gap, (ref - torch.tensor(lps)).abs().max().item())
    return gap


def test_trl_grpo_example_exact_logprobs_rising_reward(example, tiny_run, tmp_path, capsys):
    trainer = example.build_trainer(example_args(example, tiny_run, tmp_path, steps=8))
    initial = copy.deepcopy(unwrap(trainer)).eval()
    adapter = trainer.rollout_func
    checks = []

    def checked(prompts, tr):  # the rollout, then a plain forward of TRL's model on what it returned
        out = adapter(prompts, tr)
        checks.append((tr.state.global_step, logprob_gap(unwrap(tr), out, tr.args.temperature), out))
        return out

    trainer.rollout_func = checked
    trainer.train()
    steps = [s for s, _, _ in checks]
    gaps = [g for _, g, _ in checks]
    assert len(checks) == 8 and len(set(steps)) == 8, steps  # a weight sync before every rollout but the first
    assert max(gaps) < 1e-5, gaps
    # the check can fail: the last rollout is far from what the initial weights would give
    assert logprob_gap(initial, checks[-1][2], 1.0) > 1e-3
    out = checks[-1][2]
    assert set(out["finish_reason"]) <= {"stop", "length"} and len(out["spectail_seed"]) == len(out["completion_ids"])

    rewards = [r["reward"] for r in trainer.state.log_history if "reward" in r]
    assert len(rewards) == 8
    assert sum(rewards[-2:]) / 2 > rewards[0] + 0.05, rewards
    assert sum(r["reused_tokens"] for r in adapter.records[1:]) > 0  # history drafts across generations

    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("spectail rollout")]
    with capsys.disabled():
        print(f"\nTRL + spectail: max logprob gap per generation {[f'{g:.1e}' for g in gaps]}; "
              f"reward per generation {[round(r, 3) for r in rewards]}\n" + "\n".join(printed))
    assert len(printed) == 8
    assert all("tokens/s" in line and "tokens per forward" in line and "accepted/proposed" in line for line in printed)
    spectail_logged = [r for r in trainer.state.log_history if "spectail/tokens_per_second" in r]
    assert len(spectail_logged) == 8  # also in TRL's own logs


def test_seeds_and_extra_fields_reach_rewards(trainer):
    rollout = SpectailRollout(echo=None)
    prompts = [trainer.train_dataset[i]["prompt"] for i in range(2) for _ in range(trainer.num_generations)]
    out = rollout(prompts, trainer)
    again = SpectailRollout(echo=None)(prompts, trainer)
    assert out["completion_ids"] == again["completion_ids"] and out["spectail_seed"] == again["spectail_seed"]
    g = trainer.num_generations
    assert len(set(out["spectail_seed"][:g])) == g  # siblings draw different noise
    key = prompt_key(out["prompt_ids"][g])  # sample s of a prompt at the k-th rollout: sample_seed(run, key, s, k)
    assert out["spectail_seed"][g + 3] == sample_seed(trainer.args.seed, key, 3, 0)
    second = rollout(prompts, trainer)  # the next generation step: fresh noise for the same prompts
    assert not set(second["spectail_seed"]) & set(out["spectail_seed"])
    assert second["spectail_seed"][g + 3] == sample_seed(trainer.args.seed, key, 3, 1)
    for key in ("spectail_seed", "finish_reason", "spectail_accepted_tokens", "spectail_forward_passes"):
        assert len(out[key]) == len(prompts)
    assert all(isinstance(a, int) and a >= 0 for a in out["spectail_accepted_tokens"])
    twice = SpectailRollout(echo=None)(prompts[:g] * 2, trainer)  # one prompt, two groups: different noise
    assert twice["spectail_seed"][:g] == out["spectail_seed"][:g]
    assert not set(twice["spectail_seed"][g:]) & set(twice["spectail_seed"][:g])
    assert twice["spectail_seed"][g] == sample_seed(trainer.args.seed, prompt_key(twice["prompt_ids"][0]), g, 0)


def test_use_vllm_is_refused_before_any_rollout(trainer, monkeypatch):
    monkeypatch.setattr(trainer.args, "use_vllm", True)
    rollout = SpectailRollout(echo=None)
    with pytest.raises(ValueError, match="use_vllm"):
        rollout([trainer.train_dataset[0]["prompt"]] * trainer.num_generations, trainer)
    assert rollout.client is None


def test_top_p_warns_that_trl_trains_on_temperature_only(trainer, monkeypatch):
    monkeypatch.setattr(trainer.args, "top_p", 0.9)
    with pytest.warns(UserWarning, match="temperature only"):
        SpectailRollout(echo=None)([trainer.train_dataset[0]["prompt"]] * trainer.num_generations, trainer)


def test_prompt_longer_than_max_model_len_is_refused(trainer):
    rollout = SpectailRollout({"engine": {"max_model_len": 4}}, echo=None)
    with pytest.raises(ValueError, match="max_model_len is 4"):
        rollout([trainer.train_dataset[0]["prompt"]] * trainer.num_generations, trainer)
    assert rollout.client is None


def test_bad_adapter_config_is_refused():
    with pytest.raises(ValueError, match="GRPOConfig owns"):
        SpectailRollout({"temperature": 0.7})
    with pytest.raises(ValueError, match="max_model_len"):
        SpectailRollout({"engine": {"max_modle_len": 64}})


def test_unmergeable_peft_model_is_refused(trainer, monkeypatch):
    peft = pytest.importorskip("peft", reason="peft is not installed")
    prompt_tuned = peft.get_peft_model(copy.deepcopy(unwrap(trainer)),
                                       peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2))
    with pytest.raises(ValueError, match="cannot be merged"):
        check_mergeable(prompt_tuned)
    monkeypatch.setattr(trainer, "model", prompt_tuned)
    rollout = SpectailRollout(echo=None)
    with pytest.raises(ValueError, match="cannot be merged"):
        rollout([trainer.train_dataset[0]["prompt"]] * trainer.num_generations, trainer)
    assert rollout.client is None


def test_lora_weights_arrive_merged(trainer):
    peft = pytest.importorskip("peft", reason="peft is not installed")
    base = copy.deepcopy(unwrap(trainer))
    lora = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"],
                                                     init_lora_weights=False))
    ids = torch.tensor([[1, 20, 21, 22]])
    before = lora(input_ids=ids).logits
    config, weights = policy_weights(types.SimpleNamespace(model=lora, accelerator=None))
    merged = copy.deepcopy(lora).merge_and_unload().state_dict()
    assert set(weights) <= set(merged) and set(merged) - set(weights) <= {"lm_head.weight"}  # tied: stored once
    for name, t in weights.items():
        torch.testing.assert_close(t, merged[name], rtol=0, atol=1e-6)
    assert not torch.equal(weights["model.layers.0.self_attn.q_proj.weight"],
                           unwrap(trainer).state_dict()["model.layers.0.self_attn.q_proj.weight"])
    torch.testing.assert_close(lora(input_ids=ids).logits, before)  # the adapter is unmerged again


def test_group_prompts():
    assert group_prompts([[1], [1], [2], [2]], 2) == [[1], [2]]
    with pytest.raises(ValueError, match="not a multiple"):
        group_prompts([[1], [1], [2]], 2)
    with pytest.raises(ValueError, match="copies of one prompt"):
        group_prompts([[1], [2], [2], [2]], 2)


def test_multi_process_gather_generate_scatter(monkeypatch):
    """Two processes' prompts: the main one generates for both, each gets back its own slice."""
    import accelerate.utils

    locals_ = [[[1], [1]], [[2], [2]]]
    calls, sent = [], {}

    def generate_all(prompts):
        calls.append(prompts)
        return {"completion_ids": [p + [9] for p in prompts]}, {"metrics": len(prompts)}

    def broadcast(payload, from_process=0):
        if payload[0] is None:
            payload[0] = sent["payload"]
        else:
            sent["payload"] = payload[0]

    monkeypatch.setattr(accelerate.utils, "gather_object", lambda local: [p for part in locals_ for p in part])
    monkeypatch.setattr(accelerate.utils, "broadcast_object_list", broadcast)
    results = []
    for rank in (0, 1):
        acc = types.SimpleNamespace(num_processes=2, process_index=rank, is_main_process=rank == 0)
        results.append(gather_generate_scatter(locals_[rank], generate_all, acc))
    assert len(calls) == 1  # only the main process generated
    assert results[0] == ({"completion_ids": [[1, 9], [1, 9]]}, {"metrics": 4})
    assert results[1] == ({"completion_ids": [[2, 9], [2, 9]]}, {"metrics": 4})


def test_ray_backend_gives_the_local_rollout(trainer):
    pytest.importorskip("ray")
    prompts = [trainer.train_dataset[i]["prompt"] for i in range(2) for _ in range(trainer.num_generations)]
    local = SpectailRollout(echo=None)(prompts, trainer)
    remote = SpectailRollout({"backend": "ray", "num_workers": 1}, echo=None)
    try:
        out = remote(prompts, trainer)
    finally:
        remote.shutdown()
    assert out["completion_ids"] == local["completion_ids"]
    assert out["spectail_seed"] == local["spectail_seed"]
    for a, b in zip(out["logprobs"], local["logprobs"]):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5
