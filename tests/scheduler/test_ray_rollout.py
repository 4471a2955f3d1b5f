"""Rollouts on Ray workers are the local engine's rollouts: the same tokens whatever the
chunking, the order, the worker a chunk lands on, or a worker dying mid-rollout.

Runs on a local Ray with 2 CPUs; one backend (2 workers, 1 CPU each) is shared by the class
that needs it, because starting an actor costs seconds on 2 shared cores.
"""
import math
import random
import time

import pytest

ray = pytest.importorskip("ray")

from rollout import Engine, EngineConfig, SamplingParams, SpecConfig  # noqa: E402
from scheduler import RayRolloutBackend, SchedulerConfig  # noqa: E402
from scheduler.rollout_scheduler import WorkerLost  # noqa: E402
from scheduler.worker import RolloutWorker  # noqa: E402
from tests.conftest import tiny_hf_model  # noqa: E402

pytestmark = pytest.mark.ray

VOCAB = 101
CONFIG = EngineConfig(max_batch_size=4, max_model_len=96,
                      spec=SpecConfig(proposers=("history", "ngram", "suffix"), max_draft_tokens=4))


def workload(n_groups=6, per_group=3, seed=0):
    """GRPO-like groups with varying max_tokens, some stop tokens, greedy and sampled."""
    rng = random.Random(seed)
    prompts, params, groups = [], [], []
    for g in range(n_groups):
        base = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 7))]
        prompt = base * rng.randint(1, 3)
        for _ in range(per_group):
            prompts.append(prompt)
            groups.append(g)
            params.append(SamplingParams(temperature=0.0 if g == 0 else 1.0, top_k=20 if g == 1 else 0,
                                         max_tokens=rng.randint(3, 48),
                                         stop_token_ids=(5, 6, 7) if g % 2 else ()))
    seeds = [rng.getrandbits(63) for _ in prompts]
    return prompts, params, seeds, groups


def same(outs, ref, lp_tol=1e-4):
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert [o.finish_reason for o in outs] == [r.finish_reason for r in ref]
    assert [o.seed for o in outs] == [r.seed for r in ref]
    for o, r in zip(outs, ref):
        assert len(o.logprobs) == len(o.token_ids)
        assert all(math.isfinite(x) for x in o.logprobs)
        assert max((abs(a - b) for a, b in zip(o.logprobs, r.logprobs)), default=0.0) < lp_tol


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("llama", vocab=VOCAB, seed=11)


@pytest.fixture(scope="module")
def ckpt(hf, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama")
    hf.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def local(ckpt):
    return Engine.from_pretrained(ckpt, CONFIG)


@pytest.fixture(scope="module")
def reference(local):
    prompts, params, seeds, groups = workload()
    return local.generate(prompts, params, seeds=seeds, groups=groups)


# ---- policy pieces that need no workers ---------------------------------------------------------

@pytest.mark.parametrize("bad", [dict(mode="fast"), dict(chunk_tokens=0), dict(chunk_growth=-1),
                                 dict(aging=-0.1), dict(probe_factor=0.5),
                                 dict(preempt_margin=-1)])
def test_scheduler_config_rejects(bad):
    with pytest.raises(ValueError):
        SchedulerConfig(**bad).validate()


@pytest.mark.parametrize("n", [0, -1, 1.5, True])
def test_num_workers_must_be_positive(n):
    with pytest.raises(ValueError, match="num_workers"):
        RayRolloutBackend("/nowhere", num_workers=n)


# ---- two workers, shared ----------------------------------------------------------------------

@pytest.fixture(scope="class")
def backend(ray_local, ckpt):
    """Two workers of 1 CPU each, small fixed chunks (chunk_growth=0) so rollouts have many."""
    idle = []
    b = RayRolloutBackend(ckpt, CONFIG, num_workers=2, num_cpus_per_worker=1, chunk_tokens=4,
                          chunk_growth=0.0, on_idle=idle.append, start_timeout_s=120)
    b.idle_calls = idle
    yield b
    b.shutdown()


class TestTwoWorkers:
    def test_matches_local_engine(self, backend, reference):
        prompts, params, seeds, groups = workload()
        # drafts: the reference itself, corrupted every 5th token -- the history proposer's
        # state must survive the chunks, and no draft may change a token
        drafts = [[t if j % 5 != 4 else (t + 1) % VOCAB for j, t in enumerate(r.token_ids)] for r in reference]
        backend.mode = "divided+context"
        outs = backend.generate(prompts, params, seeds=seeds, groups=groups, drafts=drafts,
                                draft_logprobs=[r.logprobs for r in reference])
        same(outs, reference)
        assert sum(o.stats["accepted"].get("history", 0) for o in outs) > len(outs)
        m = backend.metrics()
        assert m["num_workers"] == 2 and m["num_samples"] == len(prompts)
        assert m["chunks"] > 2 and set(m["worker_busy_seconds"]) == {0, 1}  # both workers ran chunks
        assert 0 < m["worker_busy_fraction"] <= 1.0
        assert 0 <= m["tail_seconds"] <= m["rollout_seconds"]
        assert m["generated_tokens"] == sum(len(o.token_ids) for o in outs)
        assert 0 <= m["spec_off_steps"] < m["engine_steps"]  # the engines' own counts, summed
        # per-request stats add up over chunks: every emitted token came from a forward
        assert all(o.stats["forward_passes"] >= 1 for o in outs)
        assert all(sum(o.stats["accepted"].values()) <= sum(o.stats["proposed"].values()) for o in outs)
        assert set(backend.idle_calls) == {0, 1}  # the idle hook saw both workers

    @pytest.mark.parametrize("mode,chunk", [("static", 4), ("divided", 1), ("divided+context", 7)])
    def test_chunked_equals_unchunked(self, backend, reference, mode, chunk):
        prompts, params, seeds, groups = workload()
        backend.mode, backend.chunk_tokens = mode, chunk
        try:
            outs = backend.generate(prompts, params, seeds=seeds, groups=groups)
        finally:
            backend.mode, backend.chunk_tokens = "divided+context", 4
        same(outs, reference)
        if mode == "static":
            assert backend.metrics()["chunks"] == 2  # one run per worker, no chunks
        else:
            assert backend.metrics()["chunks"] >= max(p.max_tokens for p in params) // chunk

    def test_without_groups_and_default_seeds(self, backend, local):
        prompts, params, _, _ = workload(3, 2, seed=5)
        outs = backend.generate(prompts, params)
        ref = local.generate(prompts, params, seeds=[o.seed for o in outs])
        same(outs, ref)

    def test_bad_input_is_rejected_before_dispatch(self, backend):
        chunks = backend.metrics().get("chunks")
        with pytest.raises(ValueError, match="outside the vocabulary"):
            backend.generate([[1, 2], [3, VOCAB]], SamplingParams(max_tokens=4))
        with pytest.raises(ValueError, match="seeds"):
            backend.generate([[1, 2]], SamplingParams(max_tokens=4), seeds=[1, 2])
        assert backend.metrics().get("chunks") == chunks
        assert backend.generate([], SamplingParams()) == []

    def test_worker_killed_mid_rollout(self, backend, reference, local):
        """ray.kill a worker as soon as the first chunk comes back: nothing is lost, no token
        changes, and a replacement joins for the next rollout."""
        prompts, params, seeds, groups = workload()
        killed = []

        def kill_other(w, results):
            if not killed:
                victim = 1 - w
                killed.append(victim)
                ray.kill(backend.workers[victim])

        backend.on_chunk = kill_other
        try:
            outs = backend.generate(prompts, params, seeds=seeds, groups=groups)
        finally:
            backend.on_chunk = None
        assert killed
        same(outs, reference)
        m = backend.metrics()
        assert m["worker_failures"] >= 1 and m["requeued_requests"] >= 1
        assert backend.wait_ready(timeout_s=90) == 2  # the replacement is up
        outs = backend.generate(prompts, params, seeds=seeds, groups=groups)
        same(outs, reference)
        assert set(backend.metrics()["worker_busy_seconds"]) == {0, 1}

    def test_update_weights(self, backend, local, reference, hf):
        prompts, params, seeds, groups = workload()
        other = tiny_hf_model("llama", vocab=VOCAB, seed=12)
        backend.update_weights(other)  # a module: its state dict goes to the object store once
        local.update_weights(other)
        try:
            outs = backend.generate(prompts, params, seeds=seeds, groups=groups)
            same(outs, local.generate(prompts, params, seeds=seeds, groups=groups))
            assert [o.token_ids for o in outs] != [r.token_ids for r in reference]
            with pytest.raises(ValueError, match="unknown parameter"):
                backend.update_weights({"model.nope.weight": other.lm_head.weight})
            same(backend.generate(prompts, params, seeds=seeds, groups=groups), outs)  # unchanged
        finally:
            backend.update_weights(hf.state_dict())
            local.update_weights(hf)
        same(backend.generate(prompts, params, seeds=seeds, groups=groups), reference)


# ---- in-memory weights and start-up failures (the class backend is gone by now) ----------------

def test_in_memory_model_source(ray_local, hf, reference):
    prompts, params, seeds, groups = workload()
    with RayRolloutBackend(hf, CONFIG, num_workers=1, chunk_tokens=5, mode="divided") as b:
        same(b.generate(prompts, params, seeds=seeds, groups=groups), reference)
    with pytest.raises(RuntimeError, match="shut down"):
        b.generate(prompts, params, seeds=seeds)


def test_dead_worker_without_restart(ray_local, hf, reference):
    """Static split, a worker already dead when the rollout starts, no replacement: its share is
    run by the survivor, with the same tokens."""
    prompts, params, seeds, groups = workload()
    with RayRolloutBackend(hf, CONFIG, num_workers=2, mode="static", restart_workers=False) as b:
        ray.kill(b.workers[1])
        same(b.generate(prompts, params, seeds=seeds, groups=groups), reference)
        assert b.metrics()["worker_failures"] == 1 and list(b.workers) == [0]
        same(b.generate(prompts, params, seeds=seeds, groups=groups), reference)
        ray.kill(b.workers[0])
        with pytest.raises(RuntimeError, match="no rollout worker left"):
            b.generate(prompts, params, seeds=seeds, groups=groups)


class LosesItsEngine(RolloutWorker):
    """Worker 1 raises WorkerLost at its first chunk, as a vLLM worker does when its engine process
    dies while the worker's own process lives on (scheduler/vllm_worker.py)."""

    def run_chunk(self, work, drafter=None):
        if self.index == 1:
            raise WorkerLost("worker 1: its engine died (test)")
        return super().run_chunk(work, drafter)


def test_a_worker_whose_engine_died_is_a_lost_worker(ray_local, hf, reference):
    """WorkerLost from a worker's call is a lost worker, at once: its requests go back to the queue,
    the survivor runs them with the same tokens, and the pool's error says why. (Any other error
    from a worker's call is re-raised: it would be a bug or bad input.)"""
    prompts, params, seeds, groups = workload()
    with RayRolloutBackend(hf, CONFIG, num_workers=2, chunk_tokens=4, chunk_growth=0.0, restart_workers=False,
                           worker_cls=LosesItsEngine) as b:
        same(b.generate(prompts, params, seeds=seeds, groups=groups), reference)
        m = b.metrics()
        assert m["worker_failures"] == 1 and m["requeued_requests"] >= 1 and list(b.workers) == [0]
        assert set(m["worker_busy_seconds"]) == {0}
        assert "WorkerLost" in b._pool.last_error and "its engine died (test)" in b._pool.last_error


def test_bad_model_path_surfaces_the_worker_error(ray_local, tmp_path):
    missing = tmp_path / "no_such_checkpoint"
    t = time.perf_counter()
    with pytest.raises(RuntimeError, match="failed to start: ValueError: .*no_such_checkpoint"):
        RayRolloutBackend(str(missing), CONFIG, num_workers=1, start_timeout_s=60)
    assert time.perf_counter() - t < 60
    deadline = time.perf_counter() + 20  # the failed worker was torn down: its CPU is free again
    while ray.available_resources().get("CPU") != 2 and time.perf_counter() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU") == 2


def test_unplaceable_worker_times_out(ray_local):
    t = time.perf_counter()
    with pytest.raises(TimeoutError, match="not ready within start_timeout_s"):
        RayRolloutBackend("/nowhere", CONFIG, num_workers=1, num_gpus_per_worker=1, start_timeout_s=2)
    assert time.perf_counter() - t < 15


def test_dead_cluster_address_fails_fast(ray_local):
    t = time.perf_counter()
    with pytest.raises(ConnectionError, match="cannot reach a Ray cluster at '127.0.0.1:1'"):
        RayRolloutBackend("/nowhere", CONFIG, num_workers=1, address="127.0.0.1:1", connect_timeout_s=2)
    assert time.perf_counter() - t < 10
