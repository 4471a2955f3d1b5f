"""SIGTERM must end a run even when it lands inside a finalizer, where Python drops exceptions."""
import os
import signal
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent("""
    import importlib.util, os, signal, sys, time
    # the module alone, by its path: the package would import torch, seconds of each run
    spec = importlib.util.spec_from_file_location("sigterm", "rl_integration/sigterm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    exit_on_sigterm = module.exit_on_sigterm
    exit_on_sigterm()
    exit_on_sigterm()  # a second main() in one process must not stack the hook

    class Finalized:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100000):  # the handler runs between these bytecodes, inside __del__
                pass

    class Failing:
        def __del__(self):
            raise ValueError("boom")

    try:
        {body}
        time.sleep(10)
        print("went on", flush=True)
    finally:
        print("cleaned up", flush=True)
""")


def _run(body: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT.format(body=body)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def test_sigterm_inside_a_finalizer_still_ends_the_run():
    done = _run("obj = Finalized(); del obj")
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert done.stdout.split() == ["cleaned", "up"], done.stdout


def test_sigterm_in_plain_code_ends_the_run_once():
    done = _run("os.kill(os.getpid(), signal.SIGTERM)")
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert done.stdout.split() == ["cleaned", "up"] and done.stderr == "", (done.stdout, done.stderr)


def test_other_dropped_exceptions_still_reach_the_previous_hook():
    done = _run("obj = Failing(); del obj; sys.exit(3)")
    assert done.returncode == 3 and "boom" in done.stderr, done.stderr
