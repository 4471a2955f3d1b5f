import os
import subprocess
import sys

import pytest

from rollout import cpu

# The test session is spectail's process: passive OpenMP waiting, set before torch loads, and
# oneDNN capped below AMX (rollout/cpu.py). Importing rollout sets neither.
cpu.configure()

# the tests import them from here; they load torch, so after configure()
from tests.tiny_models import ARCH_CONFIGS, tiny_hf_model  # noqa: E402,F401


def child_stdout(code: str, without=(), **env) -> str:
    """The last line a fresh Python prints running `code` in the repository root, with the
    environment variables `without` removed and `env` set (what a process does with them)."""
    clean = {k: v for k, v in os.environ.items() if k not in without}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                         timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def llama_tiny():
    return tiny_hf_model("llama")


def pytest_terminal_summary(terminalreporter):
    from tests.fuzz_counts import summary_lines

    lines = summary_lines()
    if lines:
        terminalreporter.section("fuzz example counts")
        for line in lines:
            terminalreporter.write_line(line)
