"""`python -m benchmarks.bench --peer vllm --quick` end to end: vLLM in .venv-vllm as a subprocess,
spectail's engine beside it, rounds interleaved, the ratio printed last, JSON written."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this environment: `make test-vllm` "
                    "creates .venv-vllm and runs tests/vllm there")
from benchmarks.bench_vllm import ROOT, VLLM_PYTHON  # noqa: E402

if not VLLM_PYTHON.exists():
    pytest.skip(f"no vLLM environment at {VLLM_PYTHON} (`make venv-vllm`)", allow_module_level=True)


def test_quick_bench_runs_both_engines_and_prints_the_ratio(tmp_path):
    out = tmp_path / "peer.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench", "--peer", "vllm", "--quick", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(Path(out).read_text())
    engines = {(r["engine"], r["config"]) for r in report["records"]}
    assert engines == {("vllm", "plain"), ("spectail", "plain"), ("hf", "plain")}
    order = [(r["engine"], r["config"]) for r in report["records"] if r["engine"] != "hf"]
    assert order == [("vllm", "plain"), ("spectail", "plain")]  # quick: vLLM plain and its spectail row
    assert all(r["load_before"] and r["load_after"] and r["tokens_per_second"] > 0 for r in report["records"])
    (ratio,) = report["ratios"]
    assert ratio["vllm"] == "plain" and ratio["spectail"] == "plain" and ratio["median_ratio"] > 0
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
    assert lines[-2].strip().startswith("float32") and lines[-2].rstrip().endswith("x")  # the ratio, then "wrote"
