"""spectail as verl's rollout backend (rl_integration/verl_plugin), driven through verl's own
machinery on a local Ray on the CPU: the plugin registries, LLMServerManager and its client and
load balancer, verl's AgentLoopWorker running the "spectail_agent" loop, and the worker-side
adapter for weights and memory. Runs in .venv-verl (make test-verl); skipped elsewhere.

Two replicas of the embedded task's tiny policy: every sample's tokens equal the plain engine's with the
seed the server reports, before and after a weight update; a group's siblings share one server
and one engine batch."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

verl = pytest.importorskip("verl", reason="verl is not installed here: `make test-verl` runs these in .venv-verl")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from rollout import Engine, EngineConfig, SamplingParams  # noqa: E402

TIMEOUT_S = 300.0
N = 4  # samples per prompt (rollout.n)
RESPONSE = 24
TEMPERATURE = 1.0
TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


def bounded(coro, timeout: float = TIMEOUT_S):
    async def run():
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(run())


def tiny_policy(cache: str) -> str:
    """The embedded task's tiny warm-started policy (a checkpoint folder with its tokenizer): its
    siblings often agree, so group drafts get accepted."""
    from rl_integration.config import load_config
    from rl_integration.trainer import load_policy
    from tests.rl_integration.conftest import TINY_RUN

    return load_policy(load_config(None, TINY_RUN + [f"policy.cache_dir={cache}"]), progress=False)[2]


def verl_config(folder: str, extra=()):
    import verl.trainer.config as configs
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    r = "actor_rollout_ref.rollout"
    with initialize_config_dir(config_dir=os.path.dirname(configs.__file__), version_base=None):
        cfg = compose("ppo_trainer", overrides=[
            f"actor_rollout_ref.model.path={folder}", f"{r}.name=spectail", f"{r}.tensor_model_parallel_size=1",
            f"{r}.n={N}", f"{r}.prompt_length=16", f"{r}.response_length={RESPONSE}", f"{r}.dtype=float32",
            f"{r}.calculate_log_probs=True", f"{r}.temperature={TEMPERATURE}", f"{r}.nnodes=1",
            f"{r}.n_gpus_per_node=2", f"{r}.agent.default_agent_loop=spectail_agent",
            f"+{r}.engine_kwargs.spectail.max_batch_size=8",  # fewer slots than requests: queues
            f"+{r}.engine_kwargs.spectail.abort_chunk_tokens=5",  # chunked runs must stay exact
            f"+{r}.engine_kwargs.spectail.num_cpus=0", *extra])
    OmegaConf.update(cfg, "actor_rollout_ref.model.custom_chat_template", TEMPLATE, force_add=True)
    return cfg


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    import ray
    from verl.workers.rollout.llm_server import LLMServerManager

    folder = tiny_policy(str(tmp_path_factory.mktemp("policy-cache")))
    cfg = verl_config(folder)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

    async def start():
        return await LLMServerManager.create(cfg)

    try:
        manager = bounded(start())
        yield folder, cfg, manager
    finally:
        ray.shutdown()


def rollout_batch(cfg, manager, prompts):
    """verl's AgentLoopWorker over prompts x N, as the trainer sends them (uid per prompt, repeated)."""
    from verl import DataProto
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    worker = AgentLoopWorker(cfg, manager.get_client())
    raw = np.empty(len(prompts), dtype=object)
    raw[:] = [[{"role": "user", "content": p}] for p in prompts]
    batch = DataProto.from_dict(non_tensors={"raw_prompt": raw,
                                             "uid": np.array([f"uid-{p}" for p in prompts], dtype=object)})
    batch = batch.repeat(repeat_times=N, interleave=True)
    return bounded(worker.generate_sequences(batch))


def rows(out):
    """(prompt ids, response ids, response logprobs) of each sample, unpadded."""
    b, nt = out.batch, out.non_tensor_batch
    width = b["prompts"].shape[1]
    result = []
    for i in range(len(out)):
        prompt = b["prompts"][i][b["attention_mask"][i][:width].bool()].tolist()
        mask = b["response_mask"][i].bool()
        result.append((prompt, b["responses"][i][mask].tolist(), b["rollout_log_probs"][i][mask].tolist(),
                       int(nt["spectail_seed"][i]), nt["uid"][i], int(nt["spectail_replica"][i]),
                       int(nt["spectail_batch"][i])))
    return result


def plain_engine(folder, weights=None):
    engine = Engine.from_pretrained(folder, EngineConfig(max_batch_size=8, max_model_len=16 + RESPONSE))
    if weights is not None:
        engine.update_weights(weights)
    return engine


def check_identical(engine, samples) -> float:
    outs = engine.generate([s[0] for s in samples], SamplingParams(temperature=TEMPERATURE, max_tokens=RESPONSE,
                                                                  stop_token_ids=(2,)),
                           seeds=[s[3] for s in samples])
    for s, c in zip(samples, outs):
        assert s[1] == c.token_ids  # the same tokens as the plain engine with the reported seed
        # float32 rounding differs with the batch's shape (drafts, batch mates)
        bad = [(a, b) for a, b in zip(s[2], c.logprobs) if abs(a - b) > 1e-5]
        assert not bad, bad
    return max(abs(a - b) for s, c in zip(samples, outs) for a, b in zip(s[2], c.logprobs))


def check_groups(samples) -> None:
    by_uid = {}
    for s in samples:
        by_uid.setdefault(s[4], []).append(s)
    for uid, sibs in by_uid.items():
        assert len(sibs) == N
        assert len({s[5] for s in sibs}) == 1, uid  # one server ...
        assert len({s[6] for s in sibs}) == 1, uid  # ... one engine batch
        assert len({s[3] for s in sibs}) == N, uid  # distinct noise per sibling
    assert len({s[5] for s in samples}) == 2  # the groups spread over both replicas


def test_registries_hold_spectail(cluster):
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import get_rollout_replica_class

    from rl_integration.verl_plugin.adapter import SpectailServerAdapter
    from rl_integration.verl_plugin.replica import SpectailReplica

    assert get_rollout_replica_class("spectail") is SpectailReplica
    assert get_rollout_class("spectail", "async") is SpectailServerAdapter
    assert "spectail_agent" in _agent_loop_registry
    assert cluster[2].get_addresses() == ["spectail-replica-0", "spectail-replica-1"]


def test_tokens_equal_the_plain_engine_before_and_after_a_weight_update(cluster):
    import ray
    from verl.utils.config import omega_conf_to_dataclass

    from rl_integration.verl_plugin.adapter import SpectailServerAdapter

    folder, cfg, manager = cluster
    prompts = ["3+2\n", "1+1\n", "4+1\n", "2+2\n"]
    out = rollout_batch(cfg, manager, prompts)
    accepted = int(out.non_tensor_batch["spec_num_accepted_tokens"].sum())
    before = rows(out)
    gaps = [check_identical(plain_engine(folder), before)]
    check_groups(before)

    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}
    rollout_cfg = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    servers = [ray.get_actor(f"spectail_server_{i}_0") for i in range(2)]
    for rank, server in enumerate(servers):  # what verl's trainer workers do around a weight sync
        adapter = SpectailServerAdapter(rollout_cfg, cfg.actor_rollout_ref.model, None, replica_rank=rank)
        bounded(adapter.release())
        assert not bounded(server.state.remote())["kv_cache"]
        bounded(adapter.resume(["weights"]))
        bounded(adapter.update_weights(iter(new.items()), global_steps=1))
        bounded(adapter.resume(["kv_cache"]))
        state = bounded(server.state.remote())
        assert state["kv_cache"] and state["step"] == 1

    out = rollout_batch(cfg, manager, prompts)
    accepted += int(out.non_tensor_batch["spec_num_accepted_tokens"].sum())
    after = rows(out)
    gaps.append(check_identical(plain_engine(folder, new), after))
    check_groups(after)
    assert not {s[3] for s in after} & {s[3] for s in before}  # a new step draws fresh noise
    assert [s[1] for s in after] != [s[1] for s in before]
    assert accepted > 0  # speculation was on: siblings' drafts were accepted, and changed nothing
    print(f"verl + spectail: {len(before) + len(after)} samples token-identical to the plain engine, "
          f"max logprob gap {max(gaps):.1e}, {accepted} draft tokens accepted")


def test_abort_answers_every_request_and_the_gate_holds_new_ones(cluster):
    import ray

    _, _, manager = cluster
    server = ray.get_actor("spectail_server_0_0")
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": False,
              "ignore_eos": True}  # every request runs its full length: the batch is still running at the abort

    async def scenario():
        calls = [server.generate.remote(prompt_ids=[1, 20 + i % 7, 21], sampling_params=dict(params),
                                        request_id=f"r{i}", spectail_group=f"g{i % 16}") for i in range(64)]
        while (await server.state.remote())["running"] == 0:
            await asyncio.sleep(0.005)
        await manager.get_replicas()[0].abort_all_requests()
        outs = await asyncio.gather(*calls)
        late = server.generate.remote(prompt_ids=[1, 20, 21], sampling_params=dict(params), request_id="late")
        done, _ = await asyncio.wait([asyncio.ensure_future(late)], timeout=1.0)
        parked = not done
        await manager.get_replicas()[0].resume_generation()
        return outs, parked, await late

    outs, parked, late = bounded(scenario())
    aborted = [o for o in outs if o.stop_reason == "aborted"]
    assert aborted and all(len(o.token_ids) < RESPONSE for o in aborted)
    assert all(o.stop_reason == "completed" for o in outs if o not in aborted)
    assert parked  # held behind the closed gate until resume_generation
    assert late.stop_reason == "completed" and late.token_ids


def test_bad_settings_are_refused_by_name(cluster):
    import ray
    from verl.utils.config import omega_conf_to_dataclass

    from rl_integration.verl_plugin.replica import SpectailReplica

    folder, _, _ = cluster
    cfg = verl_config(folder, ["actor_rollout_ref.rollout.tensor_model_parallel_size=2"])
    with pytest.raises(ValueError, match="tensor_model_parallel_size=1"):
        SpectailReplica(0, omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout), cfg.actor_rollout_ref.model)
    cfg = verl_config(folder, ["+actor_rollout_ref.rollout.engine_kwargs.spectail.max_draft_tokenz=4"])
    with pytest.raises(ValueError, match="max_draft_tokenz"):
        SpectailReplica(0, omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout), cfg.actor_rollout_ref.model)
    server = ray.get_actor("spectail_server_0_0")
    bad = {"temperature": 1.0, "repetition_penalty": 1.3}
    with pytest.raises(Exception, match="repetition_penalty"):
        bounded(server.generate.remote(prompt_ids=[1, 20], sampling_params=bad, request_id="bad"))
    with pytest.raises(Exception, match="no room to generate"):
        bounded(server.generate.remote(prompt_ids=[1] * 40, sampling_params={}, request_id="long"))


def test_a_config_naming_spectail_without_the_plugin_fails_clearly():
    """verl without spectail's entry point loaded (as when spectail is not installed): its
    registries name the missing backend and the ones they have."""
    code = ("from verl.workers.rollout.replica import get_rollout_replica_class\n"
            "get_rollout_replica_class('spectail')\n")
    env = dict(os.environ, VERL_USE_EXTERNAL_PLUGINS="none")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode != 0
    assert "Unknown rollout mode: spectail" in done.stderr and "vllm" in done.stderr
