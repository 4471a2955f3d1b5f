"""`python -m benchmarks.bench_attention` at a tiny size: both orders give the same bits, and it says so."""
import json

import pytest

from benchmarks import bench_attention
from rollout.kernels import attention_kernel


def test_the_attention_bench_compares_the_same_tokens_in_two_orders(tmp_path, capsys):
    if attention_kernel.load() is None:
        pytest.skip("the CPU attention kernel could not be built here (no C compiler?)")
    out = tmp_path / "attention.json"
    report = bench_attention.main(["--contexts", "3,40", "--per-row", "1,6", "--slots", "5", "--rounds", "2",
                                   "--max-len", "64", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    assert [(r["context"], r["per_row"]) for r in report["results"]] == [(3, 1), (3, 6), (40, 1), (40, 6)]
    assert all(r["identical"] and r["rows_us_per_token"] > 0 for r in report["results"])
    assert "same bits" in capsys.readouterr().out
