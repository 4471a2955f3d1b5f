"""Threads are decided in one place: passive OpenMP waiting unless the user chose, one engine
thread for tiny models, the cores this process may use otherwise, and the caller's count restored."""
import os
import subprocess
import sys

import torch

from rollout import Engine, EngineConfig, SamplingParams, threads
from tests.conftest import tiny_hf_model

WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def _policy_in_child(code: str, **env) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in WAIT_VARS}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                         timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_importing_spectail_first_makes_openmp_wait_passively():
    show = "import os; print(os.environ.get('OMP_WAIT_POLICY'))"
    assert _policy_in_child(f"import rl_integration; {show}") == "PASSIVE"
    assert _policy_in_child(f"import scheduler; {show}") == "PASSIVE"
    assert _policy_in_child(f"import rollout; {show}", OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"  # the user's wins
    late = _policy_in_child("import torch, rollout, os; from rollout import threads; "
                            "print(os.environ.get('OMP_WAIT_POLICY'), '|', threads.wait_policy())")
    assert late.startswith("None |") and "spinning" in late  # too late to change: said so


def test_the_test_session_itself_does_not_spin():
    assert "spinning" not in threads.wait_policy()  # tests/conftest.py imports rollout before torch


def test_usable_cores_follow_affinity_and_omp_num_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = threads.usable_cores()
    assert 1 <= cores <= (os.cpu_count() or 1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what a Ray worker with num_cpus=1 gets
    assert threads.usable_cores() == 1


def test_engine_threads_by_model_size_and_the_callers_count_restored():
    assert threads.engine_threads(None, threads.SMALL_MODEL_PARAMS - 1) == 1
    assert threads.engine_threads(None, threads.SMALL_MODEL_PARAMS) == threads.usable_cores()
    assert threads.engine_threads(3, 10) == 3
    before = torch.get_num_threads()
    hf = tiny_hf_model()
    eng = Engine.from_pretrained(hf, EngineConfig(max_batch_size=2, max_model_len=32, num_threads=1))
    seen = []
    eng.generate([[1, 2, 3]], SamplingParams(max_tokens=3), seeds=[1],
                 on_finish=lambda r: seen.append(torch.get_num_threads()))
    assert seen == [1] and torch.get_num_threads() == before
