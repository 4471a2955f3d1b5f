"""The drafter on Ray: idle workers train the head while the rollout runs, versions travel with
the chunks and are loaded between them, and no token ever changes -- with versions swapped,
with a version that does not load, and with the writer killed; a chunk sent to a worker in the
middle of a training slice runs at once, stopping the slice."""
import dataclasses
import time

import pytest

ray = pytest.importorskip("ray")

import torch  # noqa: E402

from drafter.export import export, from_state, head_state  # noqa: E402
from drafter.head import DraftHead, HeadConfig  # noqa: E402
from rollout import Engine, EngineConfig, SamplingParams, SpecConfig  # noqa: E402
from rollout.config import DrafterSpec  # noqa: E402
from rollout.core.model import CausalLM  # noqa: E402
from scheduler import RayRolloutBackend  # noqa: E402
from scheduler.worker import RolloutWorker  # noqa: E402
from tests.conftest import tiny_hf_model  # noqa: E402

pytestmark = pytest.mark.ray

VOCAB = 101


def workload(seed=0):
    """Many short requests and one long one: the long tail leaves a worker idle."""
    import random

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 6))] for _ in range(10)]
    params = [SamplingParams(temperature=1.0, max_tokens=60 if i == 0 else rng.randint(6, 14)) for i in range(10)]
    return prompts, params, [seed * 100 + i for i in range(10)]


def test_idle_workers_train_and_tokens_never_change(ray_local, tmp_path):
    hf = tiny_hf_model("llama", vocab=VOCAB, seed=11)
    hf.save_pretrained(tmp_path / "policy")
    policy = CausalLM.from_pretrained(hf)
    head = DraftHead.for_policy(policy, HeadConfig(window=8), seed=1)
    export(head, tmp_path / "head")
    spec = SpecConfig(proposers=("suffix", "drafter"), max_draft_tokens=4,
                      drafter=DrafterSpec(path=str(tmp_path / "head"), idle_slice_s=0.2, window=8))
    config = EngineConfig(max_batch_size=4, max_model_len=96, spec=spec)
    plain = Engine(policy, EngineConfig(max_batch_size=4, max_model_len=96))
    backend = RayRolloutBackend(str(tmp_path / "policy"), config, num_workers=2, num_cpus_per_worker=1,
                                chunk_tokens=4, chunk_growth=0.0, start_timeout_s=120)
    try:
        published = []
        for rollout in range(2):  # the second rollout's chunks carry the first one's versions to both
            prompts, params, seeds = workload(rollout)
            outs = backend.generate(prompts, params, seeds=seeds)
            assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(prompts, params, seeds)]
            m = backend.metrics()
            assert m["drafter_train_steps"] > 0 and m["drafter_slices"] > 0 and m["drafter_published"] > 0
            assert 0 < m["worker_busy_fraction"] <= 1 and m["drafter_seconds"] > 0
            published.append(m["drafter_version"])
        assert published[1] > published[0] >= 1
        versions = [ray.get(a.ping.remote(), timeout=30)["drafter_version"] for a in backend.workers.values()]
        assert min(versions) >= published[0]  # the reader loaded a published version between chunks
        latest_version, latest = backend.published_drafter()  # what a checkpoint saves (slices in flight done)
        assert latest_version >= published[1] and from_state(latest, policy).cfg.window == 8

        bad = head_state(head)
        bad["weights"]["fc.weight"] = torch.full_like(bad["weights"]["fc.weight"], float("nan"))
        backend.publish_drafter(bad, version=10_000)
        prompts, params, seeds = workload(5)
        outs = backend.generate(prompts, params, seeds=seeds)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(prompts, params, seeds)]
        info = [ray.get(a.ping.remote(), timeout=30) for a in backend.workers.values()]
        assert all(i["drafter_refused"] == 10_000 for i in info)  # refused (the drafter off until a good one)

        writer = backend._drafter.writer
        kept = backend._drafter.published
        ray.kill(backend.workers[writer])
        prompts, params, seeds = workload(6)
        outs = backend.generate(prompts, params, seeds=seeds)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(prompts, params, seeds)]
        assert backend._drafter.published[0] >= kept[0]  # the last published version stayed
    finally:
        backend.shutdown()


class LongSliceWorker(RolloutWorker):
    """A worker whose slices are not capped at a few passes over its (tiny) buffer: a slice
    trains until its time is up or a chunk stops it."""

    def _online_config(self, dp):
        return dataclasses.replace(super()._online_config(dp), max_passes=1e9)


def test_a_chunk_does_not_wait_for_a_training_slice(ray_local, tmp_path):
    hf = tiny_hf_model("llama", vocab=VOCAB, seed=11)
    hf.save_pretrained(tmp_path / "policy")
    policy = CausalLM.from_pretrained(hf)
    export(DraftHead.for_policy(policy, HeadConfig(window=8), seed=1), tmp_path / "head")
    spec = SpecConfig(proposers=("suffix", "drafter"), max_draft_tokens=4,
                      drafter=DrafterSpec(path=str(tmp_path / "head"), window=8, idle_slice_s=None))  # no slices
    config = EngineConfig(max_batch_size=4, max_model_len=96, spec=spec)
    plain = Engine(policy, EngineConfig(max_batch_size=4, max_model_len=96))
    backend = RayRolloutBackend(str(tmp_path / "policy"), config, num_workers=2, num_cpus_per_worker=1,
                                chunk_tokens=4, chunk_growth=0.0, start_timeout_s=120,
                                worker_cls=LongSliceWorker)
    slice_s = 60.0
    try:
        backend.generate(*workload(0)[:2], seeds=workload(0)[2])  # both workers' buffers hold a rollout
        running = backend._pool.train_drafter(0, slice_s)
        prompts, params, seeds = workload(1)
        start = time.perf_counter()
        outs = backend.generate(prompts, params, seeds=seeds)  # chunks go to worker 0 too
        elapsed = time.perf_counter() - start
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(prompts, params, seeds)]
        for _ in range(12):  # (in case the slice only got the engine after the last chunk)
            backend._pool.stop_drafter(0)
            if ray.wait([running], timeout=5)[0]:
                break
        res = ray.get(running, timeout=5)
        assert elapsed < slice_s / 3, elapsed  # generous: queued behind the slice it would take > slice_s
        assert res["stopped"] and res["seconds"] < slice_s / 2, res
    finally:
        backend.shutdown()
