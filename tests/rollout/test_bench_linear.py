"""`python -m rollout.bench_linear` at a tiny size: it times both, and the kernel keeps a row's bits."""
import json

import pytest

from rollout import bench_linear, linear_kernel


def test_the_linear_bench_times_mkl_and_the_kernel(tmp_path, capsys):
    if linear_kernel.load() is None:
        pytest.skip("the linear kernel could not be built here (it needs a C compiler and AVX-512)")
    out = tmp_path / "linear.json"
    report = bench_linear.main(["--shapes", "20x12,3x40", "--rows", "1,5", "--rounds", "2", "--calls", "2",
                                "--out", str(out)])
    assert json.loads(out.read_text()) == report
    cases = [(r["shape"], r["rows"]) for r in report["results"]]
    assert cases == [("20x12", 1), ("20x12", 5), ("3x40", 1), ("3x40", 5)]
    assert all(r["kernel_same_bits"] and r["kernel_us"] > 0 and r["mkl_us"] > 0 for r in report["results"])
    assert "same bits" in capsys.readouterr().out
