"""The JSON report writer rollout/bench_spec.py imports (`from .bench import save_report`): the
benchmarks moved to benchmarks/ (benchmarks/bench.py has its own copy); this file goes with
bench_spec.py when that leaves the package."""
from __future__ import annotations

import json
from pathlib import Path


def save_report(report: dict, path: str, quiet: bool = False) -> dict:
    """Write a benchmark's JSON (folders made as needed) and say where (unless quiet)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=2) + "\n")
    if not quiet:
        print(f"wrote {path}")
    return report
