"""Importing spectail changes nothing in the process: no OpenMP wait policy, no oneDNN cap, torch's
thread count and the garbage collector as they were (rollout/cpu.py is the explicit way)."""
import gc
import json

from rollout import Engine, EngineConfig, SamplingParams, cpu
from tests.conftest import child_stdout, tiny_hf_model

SHOW = """
import gc, json, os, torch
threads, gc_on = torch.get_num_threads(), gc.isenabled()
{imports}
print(json.dumps([{{v: os.environ.get(v) for v in {variables!r}}}, torch.get_num_threads() == threads,
                  gc.isenabled() == gc_on, torch.get_num_threads()]))
"""


def _effects(imports: str, first: str = "") -> list:
    code = first + SHOW.format(imports=imports, variables=cpu.VARIABLES)
    return json.loads(child_stdout(code, cpu.VARIABLES + ("GOMP_SPINCOUNT", "KMP_BLOCKTIME")))


def test_importing_every_package_leaves_the_process_alone():
    unset = {v: None for v in cpu.VARIABLES}
    every = "import rollout, drafter, scheduler, rl_integration, rl_integration.cli, rollout.core.engine"
    assert _effects(every)[:3] == [unset, True, True]
    # before torch loads, too (OpenMP would read the wait policy then)
    before_torch = child_stdout("import rollout, rl_integration, drafter, scheduler, os, json; "
                                f"print(json.dumps({{v: os.environ.get(v) for v in {cpu.VARIABLES!r}}}))",
                                cpu.VARIABLES)
    assert json.loads(before_torch) == unset

def test_importing_rollout_loads_no_torch_so_configure_can_come_first():
    assert child_stdout("import sys, rollout, rl_integration; print('torch' in sys.modules)") == "False"


def test_configure_sets_both_and_says_what_it_set():
    set_ = _effects("", first="from rollout import cpu; print(cpu.configure())\n")[0]
    assert set_ == {"OMP_WAIT_POLICY": "PASSIVE", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "DNNL_MAX_CPU_ISA": None}


def test_an_engine_run_leaves_the_garbage_collector_as_it_found_it():
    eng = Engine.from_pretrained(tiny_hf_model(), EngineConfig(max_batch_size=2, max_model_len=32, num_threads=1))
    seen = []
    was = gc.isenabled()
    try:
        for on in (False, True):
            (gc.enable if on else gc.disable)()
            eng.generate([[1, 2, 3]], SamplingParams(max_tokens=3), seeds=[1],
                         on_finish=lambda r: seen.append(gc.isenabled()))
            assert gc.isenabled() == on
    finally:
        (gc.enable if was else gc.disable)()
    assert seen == [False, False]  # off while the loop runs (engine.py says why)


def test_the_command_line_configures_its_process_before_torch_loads():
    code = ("import os, sys\nfrom rl_integration import cli\n"
            "try:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('ONEDNN_MAX_CPU_ISA'), 'torch' in sys.modules)")
    assert child_stdout(code, cpu.VARIABLES) == "PASSIVE AVX512_CORE_BF16 False"
