"""rollout.cpu.configure() caps oneDNN below AMX (a bfloat16 row's bits must not depend on the call's
row count), the user's own cap wins, an engine says so when its rows' bits would depend on the
call (no cap and no AMX kernel of ours), and vLLM's processes run without it."""
import os

import pytest
import torch

from rollout.kernels import amx_linear, cpu_isa
from rollout.vllm_backend import backend as vllm_backend
from tests.conftest import child_stdout

# An engine in bfloat16 on a tiny model, built in a child: it reports the probe and any warning.
ENGINE = """
import warnings, torch{first}
from rollout import Engine, EngineConfig, cpu
from rollout.kernels import cpu_isa
{configure}
from tests.tiny_models import tiny_hf_model
hf = tiny_hf_model("llama")
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    Engine.from_pretrained(hf, EngineConfig(max_batch_size=2, max_model_len=32, dtype="bfloat16", num_threads=1))
print(cpu_isa.rows_invariant(), any("AMX" in str(w.message) for w in seen))
"""


def _child(code: str, **env) -> str:
    return child_stdout(code, cpu_isa.ISA_VARS, **env)


def _amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_bf16" in f.read()
    except OSError:
        return False


def test_configure_caps_onednn_unless_the_user_chose():
    show = "import os; print(os.environ.get('ONEDNN_MAX_CPU_ISA'), os.environ.get('DNNL_MAX_CPU_ISA'))"
    configure = "from rollout import cpu; cpu.configure()"
    assert _child(f"{configure}; {show}") == f"{cpu_isa.CAP} None"
    assert _child(f"import scheduler, torch; {configure}; {show}") == f"{cpu_isa.CAP} None"
    assert _child(f"{configure}; {show}", ONEDNN_MAX_CPU_ISA="AVX512_CORE_AMX") == "AVX512_CORE_AMX None"
    assert _child(f"{configure}; {show}", DNNL_MAX_CPU_ISA="AVX2") == "None AVX2"
    assert _child(f"import rollout, scheduler; {show}") == "None None"  # importing caps nothing


def test_the_test_session_computes_bfloat16_rows_alike():
    assert os.environ.get("ONEDNN_MAX_CPU_ISA") == cpu_isa.CAP  # tests/conftest.py calls cpu.configure()
    assert cpu_isa.rows_invariant()


@pytest.mark.skipif(not _amx(), reason="this CPU has no AMX: oneDNN's bfloat16 rows are alike without the cap")
@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN runs no bfloat16 here")
def test_without_the_cap_amx_rows_differ_and_the_engine_warns_unless_its_layers_run_on_our_tiles():
    def engine(first="", configure="cpu.configure()", **env):
        return _child(ENGINE.format(first=first, configure=configure), **env)

    assert engine() == "True False"
    # with the C kernels off the engine's bfloat16 layers run through oneDNN
    assert engine(ONEDNN_MAX_CPU_ISA="AVX512_CORE_AMX", SPECTAIL_C_KERNELS="0") == "False True"
    assert engine(configure="", SPECTAIL_C_KERNELS="0") == "False True"  # nobody capped oneDNN
    # oneDNN made its kernels before the cap was set: too late to cap, and said so
    late = "\ntorch.ops.mkldnn._reorder_linear_weight(torch.ones(64, 64, dtype=torch.bfloat16), 32)"
    assert engine(first=late, SPECTAIL_C_KERNELS="0") == "False True"
    if amx_linear.load() is not None:  # rollout/kernels/amx_kernel.c keeps a row's bits: nothing to warn about
        assert engine(ONEDNN_MAX_CPU_ISA="AVX512_CORE_AMX") == "False False"
        assert engine(configure="") == "False False"  # the user's process, not configured: still exact


def test_vllm_runs_without_the_cap_set_here_but_keeps_the_users(monkeypatch):
    assert cpu_isa.uncapped({"ONEDNN_MAX_CPU_ISA": cpu_isa.CAP}) == {"ONEDNN_MAX_CPU_ISA": "ALL"}
    assert cpu_isa.uncapped({"ONEDNN_MAX_CPU_ISA": "AVX2"}) == {}
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cpu_isa.CAP)
    with vllm_backend.environment({"VLLM_CPU_KVCACHE_SPACE": "1", **cpu_isa.uncapped(os.environ)}):
        assert os.environ["ONEDNN_MAX_CPU_ISA"] == "ALL" and os.environ["VLLM_CPU_KVCACHE_SPACE"] == "1"
        # a vLLM process that configures spectail keeps it (its cap is the user's now)
        assert _child("from rollout import cpu; import os; cpu.configure(); print(os.environ['ONEDNN_MAX_CPU_ISA'])",
                      ONEDNN_MAX_CPU_ISA="ALL") == "ALL"
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == cpu_isa.CAP
