"""`python -m benchmarks.bench --spec` on a tiny model: every configuration's tokens are checked against
plain decoding inside the bench, the A/A pair is reported, and the JSON is written after each cell."""
import json

from benchmarks import bench_spec


def test_the_spec_bench_reports_an_a_a_pair_and_keeps_finished_cells(tmp_path, monkeypatch):
    out = tmp_path / "spec.json"
    seen = []
    measure = bench_spec._measure

    def measured(name, batch, args):  # the JSON after the first cell already holds it
        if seen:
            assert [r["batch"] for r in json.loads(out.read_text())["results"]] == seen
        seen.append(batch)
        return measure(name, batch, args)

    monkeypatch.setattr(bench_spec, "_measure", measured)
    report = bench_spec.main(["--workloads", "zero", "--batches", "1,2", "--rounds", "1", "--tokens", "4",
                              "--hidden", "32", "--layers", "1", "--vocab", "64", "--threads", "1",
                              "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["complete"] and report["complete"] and [r["batch"] for r in saved["results"]] == [1, 2]
    for row in saved["results"]:
        assert row["plain_again_over_plain"] > 0 and "plain again" in row["median_s"]
