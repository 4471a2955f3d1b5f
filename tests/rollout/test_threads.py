"""Threads are decided in one place: passive OpenMP waiting when configured (unless the user chose), one engine
thread for tiny models, the cores this process may use otherwise, and the caller's count restored."""
import os

import torch

from rollout import Engine, EngineConfig, SamplingParams
from rollout.core import threads
from tests.conftest import child_stdout, tiny_hf_model

WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def _policy_in_child(code: str, **env) -> str:
    return child_stdout(code, WAIT_VARS, **env)


def test_configuring_before_torch_makes_openmp_wait_passively():
    show = "import os; print(os.environ.get('OMP_WAIT_POLICY'))"
    configure = "from rollout import cpu; cpu.configure()"
    assert _policy_in_child(f"{configure}; import rl_integration, torch; {show}") == "PASSIVE"
    assert _policy_in_child(f"{configure}; import scheduler; {show}") == "PASSIVE"
    assert _policy_in_child(f"{configure}; {show}", OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"  # the user's wins
    assert _policy_in_child(f"import rl_integration, scheduler; {show}") == "None"  # importing sets nothing
    late = _policy_in_child(f"import torch; {configure}; import os; from rollout.core import threads; "
                            "print(os.environ.get('OMP_WAIT_POLICY'), '|', threads.wait_policy())")
    assert late.startswith("None |") and "spinning" in late  # too late to change: said so


def test_the_test_session_itself_does_not_spin():
    assert "spinning" not in threads.wait_policy()  # tests/conftest.py configures before torch loads


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


def test_free_threads_leave_the_cores_other_programs_hold():
    assert threads.free_threads(2, 0.05, 2) == 2  # a quiet machine
    assert threads.free_threads(2, 0.4, 2) == 2
    assert threads.free_threads(2, 0.6, 2) == 1  # a busy program beside us
    assert threads.free_threads(2, 2.7, 2) == 1  # never fewer than one
    assert threads.free_threads(8, 3.0, 4) == 4  # never more than asked
    assert threads.free_threads(8, 6.2, 4) == 2


class ScriptedWatch(threads.CoreWatch):
    """/proc/stat as a script: per look, (wall s, busy core-seconds of the cores, own CPU s)."""

    def __init__(self, cores, looks):
        super().__init__(cores)
        self.looks = iter(looks)

    def _look(self):
        return next(self.looks)


def test_a_core_watch_counts_other_programs_not_this_one():
    # 2 cores, 10 s apart: 19 busy core-seconds of which 18 were this process's own run
    watch = ScriptedWatch((0, 1), [(10.0, 19.0, 18.0)])
    watch.last = (0.0, 0.0, 0.0)
    assert watch.threads(2) == 2
    # the next 10 s: 18 busy core-seconds, only 9 of them ours: another program held a core
    watch.looks = iter([(20.0, 37.0, 27.0)])
    assert watch.threads(2) == 1
    # a look right after the last one holds too few ticks to judge: the last choice stands
    watch.looks = iter([(20.1, 37.1, 27.0)])
    assert watch.threads(2) == 1 and watch.last == (20.0, 37.0, 27.0)


def test_an_engine_that_chose_its_threads_runs_with_the_free_cores():
    eng = Engine.from_pretrained(tiny_hf_model(), EngineConfig(max_batch_size=2, max_model_len=32))
    assert eng.num_threads == 1 and eng.cores is None  # a small model: one thread, nothing to watch
    eng.num_threads = 2
    eng.cores = ScriptedWatch((0, 1), [(10.0, 19.0, 0.0), (20.0, 20.0, 0.5)])
    eng.cores.last = (0.0, 0.0, 0.0)
    seen = []
    for _ in range(2):
        eng.generate([[1, 2, 3]], SamplingParams(max_tokens=2), seeds=[1],
                     on_finish=lambda r: seen.append(torch.get_num_threads()))
    assert seen == [1, 2]  # 1.9 cores busy with others, then 0.05
    if threads.CoreWatch.of_this_process() is not None:  # Linux: the real /proc/stat reads
        busy = threads.CoreWatch.of_this_process()
        assert 1 <= busy.threads(2) <= 2


def test_an_engine_keeps_one_thread_where_a_second_measured_slower():
    import time

    eng = Engine.from_pretrained(tiny_hf_model(), EngineConfig(max_batch_size=2, max_model_len=32))
    real = eng.model

    class Slower:
        """The engine's model, slower at one thread count (as on virtual CPUs sharing a core)."""

        def __init__(self, slow):
            self.slow = slow

        def __call__(self, batch, cache):
            if torch.get_num_threads() == self.slow:
                time.sleep(0.02)
            return real(batch, cache)

    before = torch.get_num_threads()
    for slow, chosen in ((2, 1), (1, 2)):
        eng.model = Slower(slow)
        assert eng._fastest_threads(2) == chosen
    assert torch.get_num_threads() == before
