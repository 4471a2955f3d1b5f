"""`python -m benchmarks.bench_linear` and `benchmarks.bench_amx` at a tiny size: each times its peer
(MKL, oneDNN) and our kernel, and the kernel keeps a row's bits."""
import json

import pytest

from benchmarks import bench_amx, bench_linear
from rollout.kernels import amx_linear, linear_kernel

BENCHES = {"float32 (linear_kernel)": (bench_linear, linear_kernel, "mkl", "it needs a C compiler and AVX-512"),
           "bfloat16 (amx_kernel)": (bench_amx, amx_linear, "onednn", "it needs AMX-BF16, Linux and a C compiler")}


@pytest.mark.parametrize("name", list(BENCHES))
def test_a_linear_bench_times_its_peer_and_the_kernel(name, tmp_path, capsys):
    bench, kernel, peer, needs = BENCHES[name]
    if kernel.load() is None:
        pytest.skip(f"the kernel could not be used here ({needs})")
    out = tmp_path / "linear.json"
    report = bench.main(["--shapes", "20x40,3x64", "--rows", "1,17", "--rounds", "2", "--calls", "2",
                         "--out", str(out)])
    assert json.loads(out.read_text()) == report
    cases = [(r["shape"], r["rows"]) for r in report["results"]]
    assert cases == [("20x40", 1), ("20x40", 17), ("3x64", 1), ("3x64", 17)]
    assert all(r["kernel_same_bits"] and r["kernel_us"] > 0 and r[f"{peer}_us"] > 0 for r in report["results"])
    assert "same bits" in capsys.readouterr().out
