"""vLLM engines on Ray workers, behind the rollout scheduler (divided rollout, context-aware
order, group affinity, recovery), on a local Ray of 2 CPUs:
- the demo's GRPO for 2 steps on 2 vLLM workers, driven from the main environment (.venv, no
  vLLM) the way a user runs it: the workers run .venv-vllm's python (runtime_env py_executable);
- on one shared pair of workers built as `rollout.name=vllm, rollout.backend=ray` builds them:
  chunked greedy rollouts are spectail's greedy tokens, sampled ones carry the policy's own
  logprobs, a weight update changes the outputs as the new weights dictate, a bad one is refused
  with both engines still usable, and a worker whose vLLM engine dies mid-rollout loses no
  sample (last: the pair is one worker short afterwards)."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this environment: `make test-vllm` "
                    "creates .venv-vllm and runs tests/vllm there")
pytest.importorskip("ray", reason="Ray is not installed in .venv-vllm (`make venv-vllm` adds it)")

import torch  # noqa: E402

from rl_integration.config import load_config  # noqa: E402
from rl_integration.metrics import read_jsonl  # noqa: E402
from rl_integration.rollout_client import build_backend  # noqa: E402
from rl_integration.trainer import load_policy, load_problems  # noqa: E402
from rollout import Engine, EngineConfig, SamplingParams  # noqa: E402
from rollout.core.sampling import token_logprobs  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MAIN_PYTHON = ROOT / ".venv" / "bin" / "python"
RAY = ["rollout.backend=ray", "rollout.num_workers=2", "rollout.chunk_tokens=8"]
MAX_TOKENS = 24


def test_demo_grpo_on_two_ray_vllm_workers_from_the_main_environment(vllm_run, tmp_path):
    """The command line, in .venv when it exists (else this Python): the driver, trainer and
    scheduler there, each worker a vLLM engine in .venv-vllm."""
    python = MAIN_PYTHON if MAIN_PYTHON.exists() else Path(sys.executable)
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([str(python), "-m", "rl_integration.cli", "train", "--config", "examples/demo.yaml",
                           *vllm_run, *RAY, "--out", str(out), "--quiet"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        assert r["reward_mean"] is not None and r["num_samples"] == 64 and r["generated_tokens"] > 0
        assert r["logprob_diff"] < 1e-3  # vLLM's logprobs against the trainer's, first minibatch, mean
        assert r["weight_update_seconds"] > 0 and r["engine_steps"] > 0 and r["worker_busy_fraction"] > 0
    assert "step reward" in proc.stdout
    if python == MAIN_PYTHON:
        assert "vllm" not in subprocess.run([str(python), "-m", "pip", "list"], capture_output=True,
                                            text=True, timeout=120).stdout.split()


# ---- one pair of vLLM workers for the rest ---------------------------------------------------------

@pytest.fixture(scope="module")
def policy(vllm_run):
    cfg = load_config(None, vllm_run + RAY)
    model, tokenizer, folder = load_policy(cfg, progress=False)
    prompts = [tokenizer(p.prompt)["input_ids"] for p in load_problems(cfg)]
    return cfg, model, folder, prompts, tokenizer.eos_token_id


@pytest.fixture(scope="module")
def backend(policy, ray_cluster):
    cfg, _, folder, _, _ = policy
    b = build_backend(cfg.rollout, folder, cfg.rollout.engine)  # as RolloutClient builds it
    b.scheduler_config.chunk_timeout_s = 600.0
    b.chunk_tokens, b.scheduler_config.chunk_growth = 3, 0.0  # short chunks: every request is continued
    yield b
    b.shutdown()


def workload(policy, temperature: float, groups: int = 4, n: int = 4):
    _, _, _, prompts, eos = policy
    chosen = [prompts[g] for g in range(groups) for _ in range(n)]
    params = SamplingParams(temperature=temperature, max_tokens=MAX_TOKENS, stop_token_ids=(eos,))
    return chosen, params, list(range(1000, 1000 + len(chosen))), [g for g in range(groups) for _ in range(n)]


def spectail_greedy(model_or_folder, prompts, params, seeds):
    engine = Engine.from_pretrained(model_or_folder, EngineConfig(max_batch_size=16, max_model_len=64))
    return [o.token_ids for o in engine.generate(prompts, params, seeds=seeds)]


def check_logprobs(model, prompts, outs, params, tol=1e-3):
    for prompt, out in zip(prompts, outs):
        assert len(out.logprobs) == len(out.token_ids) >= 1
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1].float()
        m = len(out.token_ids)
        expected = token_logprobs(logits, torch.full((m,), params.temperature), torch.zeros(m, dtype=torch.long),
                                  torch.ones(m), torch.tensor(out.token_ids))
        assert torch.allclose(torch.tensor(out.logprobs), expected, atol=tol), (out.logprobs, expected.tolist())


def test_chunked_greedy_rollout_is_spectails_greedy(backend, policy):
    prompts, params, seeds, groups = workload(policy, temperature=0.0)
    outs = backend.generate(prompts, params, seeds=seeds, groups=groups)
    assert [o.token_ids for o in outs] == spectail_greedy(policy[2], prompts, params, seeds)
    m = backend.metrics()
    longest = max(len(o.token_ids) for o in outs)
    assert longest > 3 and m["chunks"] > 2  # requests ran in several chunks, on both workers
    assert set(m["worker_busy_seconds"]) == {0, 1} and m["worker_failures"] == 0
    assert m["engine_steps"] > 0 and m["fed_tokens"] > sum(len(p) for p in prompts)


def test_sampled_rollout_carries_the_policys_logprobs(backend, policy):
    prompts, params, seeds, groups = workload(policy, temperature=1.0)
    outs = backend.generate(prompts, params, seeds=seeds, groups=groups)
    assert [o.seed for o in outs] == seeds
    assert all(o.finish_reason in ("stop", "length") and len(o.token_ids) <= MAX_TOKENS for o in outs)
    assert all(o.token_ids[-1] == policy[4] for o in outs if o.finish_reason == "stop")
    check_logprobs(policy[1], prompts, outs, params)


def test_weight_update_changes_outputs_as_the_new_weights_dictate(backend, policy):
    _, model, folder, _, _ = policy
    prompts, params, seeds, groups = workload(policy, temperature=0.0)
    before = [o.token_ids for o in backend.generate(prompts, params, seeds=seeds, groups=groups)]
    torch.manual_seed(5)
    moved = {k: v + 0.2 * torch.randn_like(v) for k, v in model.state_dict().items()}
    try:
        backend.update_weights(moved)
        after = [o.token_ids for o in backend.generate(prompts, params, seeds=seeds, groups=groups)]
        expected = spectail_greedy((model.config, moved), prompts, params, seeds)
        assert after == expected and after != before
        bad = {"model.norm.weight": moved["model.norm.weight"], "lm_head.weight": torch.zeros(3, 3)}
        with pytest.raises(ValueError, match="lm_head.weight"):
            backend.update_weights(bad)
        assert [o.token_ids for o in backend.generate(prompts, params, seeds=seeds, groups=groups)] == expected
    finally:
        backend.update_weights(model.state_dict())
    assert [o.token_ids for o in backend.generate(prompts, params, seeds=seeds, groups=groups)] == before


def children(pid: int) -> list[int]:
    """The child processes of `pid` (Linux /proc)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            text = (task / "children").read_text().split()
        except FileNotFoundError:  # a thread that ended after the listing: it has no children now
            continue
        out += [int(c) for c in text]
    return out


def test_a_vllm_worker_dying_mid_rollout_loses_no_sample(backend, policy):
    """As soon as one chunk comes back, the other worker's vLLM engine process is killed (what the
    OOM killer does) while that worker waits on it mid-chunk: its call fails at once with
    WorkerLost naming the worker and the dead engine (not the scheduler's chunk timeout, which the
    fixture sets to 600 s: vLLM's own client would wait forever, rollout/vllm_backend/backend.py
    `failing_fast`), the worker is dropped, its requests go back to the queue and the survivor
    finishes them. Every sample is complete, greedy ones are still spectail's greedy tokens and
    sampled ones carry the policy's logprobs."""
    greedy, g_params, g_seeds, g_groups = workload(policy, temperature=0.0, groups=2)
    sampled, s_params, s_seeds, s_groups = workload(policy, temperature=1.0, groups=2)
    prompts, seeds = greedy + sampled, g_seeds + [s + 100 for s in s_seeds]
    params = [g_params] * len(greedy) + [s_params] * len(sampled)
    groups = g_groups + [g + 2 for g in s_groups]
    killed = []

    def kill_the_others_engine(w, results):
        if not killed:
            victim = backend.worker_info[1 - w]["pid"]
            engines = children(victim)
            for pid in engines:
                os.kill(pid, signal.SIGKILL)
            killed.append(engines)

    backend.on_chunk = kill_the_others_engine
    try:
        outs = backend.generate(prompts, params, seeds=seeds, groups=groups)
    finally:
        backend.on_chunk = None
    m = backend.metrics()
    assert killed and killed[0] and m["worker_failures"] >= 1 and m["requeued_requests"] >= 1
    error = backend._pool.last_error
    assert "WorkerLost" in error and "its vLLM engine died" in error and "exit code -9" in error, error
    assert len(outs) == len(prompts) and all(o.finish_reason in ("stop", "length") for o in outs)
    assert [o.token_ids for o in outs[:len(greedy)]] == spectail_greedy(policy[2], greedy, g_params, g_seeds)
    check_logprobs(policy[1], sampled, outs[len(greedy):], s_params)
