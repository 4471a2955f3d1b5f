"""How a run config chooses vLLM (rollout.name=vllm) and what that builds, without vLLM itself:
the config's checks, the backend build_backend makes (local or Ray workers holding vLLM, and
which Python those run), and the clear errors when there is no vLLM to run."""
import importlib.util
import sys

import pytest

from rl_integration.config import load_config
from rl_integration.rollout_client import RolloutClient, build_backend
from rollout.vllm_backend.config import VllmConfig
from scheduler import vllm_worker
from tests.conftest import tiny_hf_model

VLLM = ["rollout.name=vllm", "rollout.engine.spec=null"]


def test_the_engine_is_chosen_by_name_and_vllms_speculation_is_its_own():
    assert load_config(None, []).rollout.name == "spectail"
    cfg = load_config(None, VLLM + ["rollout.vllm.speculation=suffix", "rollout.vllm.num_speculative_tokens=6"])
    assert cfg.rollout.vllm == VllmConfig(speculation="suffix", num_speculative_tokens=6)
    with pytest.raises(ValueError, match="'rollout.engine.spec' must be null when rollout.name is 'vllm'"):
        load_config(None, ["rollout.name=vllm"])  # the demo's engine speculates with spectail's proposers
    with pytest.raises(ValueError, match="'rollout.name': expected one of \\['spectail', 'vllm'\\]"):
        load_config(None, ["rollout.name=sglang"])
    with pytest.raises(ValueError, match="'rollout.vllm.speculation': expected one of \\['ngram', 'suffix'\\]"):
        load_config(None, VLLM + ["rollout.vllm.speculation=eagle"])
    with pytest.raises(ValueError, match="'rollout.vllm.kv_cache_gib' must be an integer >= 1"):
        load_config(None, VLLM + ["rollout.vllm.kv_cache_gib=0"])


class Recorder:
    """Stands in for a backend class: records how it was built."""

    made: list = []

    def __init__(self, *args, **kwargs):
        Recorder.made.append((args, kwargs))


def test_local_vllm_backend_gets_the_model_engine_and_vllm_config(monkeypatch):
    import rollout.vllm_backend

    monkeypatch.setattr(rollout.vllm_backend, "VllmBackend", Recorder)
    monkeypatch.setattr(rollout.vllm_backend, "import_vllm", lambda: None)
    Recorder.made.clear()
    cfg = load_config(None, VLLM + ["rollout.vllm.speculation=suffix"]).rollout
    model = tiny_hf_model()
    build_backend(cfg, model, cfg.engine)
    build_backend(cfg, model, cfg.engine, plain=True)  # --compare's reference: vLLM without its speculation
    (args, _), (plain_args, _) = Recorder.made
    assert args == (model, cfg.engine, cfg.vllm) and plain_args[2] == VllmConfig(speculation=None)


def test_ray_workers_hold_vllm_and_run_the_python_that_has_it(monkeypatch, tmp_path):
    import scheduler.ray_backend

    monkeypatch.setattr(scheduler.ray_backend, "RayRolloutBackend", Recorder)
    checked = []
    monkeypatch.setattr(vllm_worker, "check_python", checked.append)
    Recorder.made.clear()
    cfg = load_config(None, VLLM + ["rollout.backend=ray", "rollout.num_workers=2",
                                    f"rollout.vllm.python={tmp_path}/bin/python"]).rollout
    build_backend(cfg, "ckpt", cfg.engine)
    ((args, kwargs),) = Recorder.made
    assert args == ("ckpt", cfg.engine) and kwargs["num_workers"] == 2
    assert kwargs["worker_cls"] is vllm_worker.VllmRolloutWorker and kwargs["worker_kwargs"] == {"vllm": cfg.vllm}
    assert kwargs["actor_options"] == {"runtime_env": {"py_executable": f"{tmp_path}/bin/python"}}
    assert checked == [f"{tmp_path}/bin/python"]


def without_vllm(monkeypatch, tmp_path):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setattr(vllm_worker, "VENV_PYTHON", tmp_path / "no-venv" / "bin" / "python")


def test_no_vllm_anywhere_is_a_clear_error_naming_make_venv_vllm(monkeypatch, tmp_path):
    without_vllm(monkeypatch, tmp_path)
    cfg = load_config(None, VLLM).rollout
    with pytest.raises(ValueError, match="rollout.name is 'vllm'.*make venv-vllm"):
        RolloutClient(cfg, tiny_hf_model())
    ray_cfg = load_config(None, VLLM + ["rollout.backend=ray"]).rollout
    with pytest.raises(ValueError, match="needs a Python with vLLM: `make venv-vllm`"):
        build_backend(ray_cfg, "ckpt", ray_cfg.engine)


def test_a_workers_python_without_vllm_or_ray_is_refused_before_any_actor(tmp_path):
    pytest.importorskip("ray")
    with pytest.raises(ValueError, match="does not run"):
        vllm_worker.check_python(str(tmp_path / "missing" / "python"))
    if importlib.util.find_spec("vllm") is None:  # this Python has Ray but not vLLM
        with pytest.raises(ValueError, match="has no vLLM; `make venv-vllm`"):
            vllm_worker.check_python(sys.executable)


def test_each_steps_record_has_the_seconds_of_its_weight_updates():
    cfg = load_config(None, ["rollout.engine.spec=null", "rollout.max_tokens=4"]).rollout
    model = tiny_hf_model()
    client = RolloutClient(cfg, model, history_dir=None)
    client.generate([[1, 2, 3]], n=2)
    assert client.step_metrics()["weight_update_seconds"] is None  # none yet
    client.update_weights(model)
    client.update_weights(model)
    record = client.end_step()
    assert record["weight_update_seconds"] > 0 and client.step_metrics()["weight_update_seconds"] is None


def test_a_vllm_worker_answers_every_call_the_scheduler_makes_of_a_worker():
    """The scheduler drives both kinds of Ray worker through one pool: each method it calls must
    take the spectail worker's arguments (a chunk carries the drafter's newest version too)."""
    import inspect

    from scheduler.worker import RolloutWorker

    def params(cls, name):  # (ray.remote adds a tracing context parameter to a class it has wrapped)
        return [p for p in inspect.signature(getattr(cls, name)).parameters if p != "_ray_trace_ctx"]

    for name in ("run_chunk", "update_weights", "ping"):
        assert params(vllm_worker.VllmRolloutWorker, name) == params(RolloutWorker, name), name
