"""`python -m rollout.bench_amx` at a tiny size: it times both, and the kernel keeps a row's bits."""
import json

import pytest

from rollout import amx_linear, bench_amx


def test_the_amx_bench_times_onednn_and_the_kernel(tmp_path, capsys):
    if amx_linear.load() is None:
        pytest.skip("no AMX tiles here (CPU without AMX-BF16, or the kernel could not be built)")
    out = tmp_path / "amx.json"
    report = bench_amx.main(["--shapes", "20x40,48x64", "--rows", "1,17", "--rounds", "2", "--calls", "2",
                             "--out", str(out)])
    assert json.loads(out.read_text()) == report
    cases = [(r["shape"], r["rows"]) for r in report["results"]]
    assert cases == [("20x40", 1), ("20x40", 17), ("48x64", 1), ("48x64", 17)]
    assert all(r["kernel_same_bits"] and r["kernel_us"] > 0 and r["onednn_us"] > 0 for r in report["results"])
    assert "same bits" in capsys.readouterr().out
