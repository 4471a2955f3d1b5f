"""Rollout metrics: one record per `RolloutClient.generate` call, aggregated per step (sums, and
ratios recomputed from the sums), written as JSON lines; plus the per-step table the command line
prints. Each key is defined in docs/configuration.md (Outputs). Files are replaced atomically.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Iterable, Optional, Sequence

from scheduler.atomic_file import atomic_write_text

SUM_KEYS = ("rollout_seconds", "generated_tokens", "forward_passes", "num_requests", "reused_tokens",
            "engine_steps", "spec_off_steps", "tail_seconds", "lenient_tokens", "history_found", "fed_tokens")


def step_metrics(completions, seconds: float, backend_metrics: Optional[dict] = None) -> dict:
    """One generate call's record from the backend's Completions, the wall time and the backend's
    own figures (RolloutBackend.metrics())."""
    tokens = sum(len(c.token_ids) for c in completions)
    forwards = sum(int(c.stats.get("forward_passes", 0)) for c in completions)
    proposed = sum_counts(c.stats.get("proposed", {}) for c in completions)
    accepted = sum_counts(c.stats.get("accepted", {}) for c in completions)
    by_position = add_positions({}, (c.stats.get("by_position", {}) for c in completions))
    bm = dict(backend_metrics or {})
    return {
        "rollout_seconds": float(seconds),
        "generated_tokens": tokens,
        "tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
        "forward_passes": forwards,
        "num_requests": len(completions),
        "accepted_per_verify": tokens / (forwards + len(completions)) if completions else 0.0,
        "proposed": proposed,
        "accepted": accepted,
        "reused_tokens": accepted.get("history", 0),
        "by_position": by_position,
        "acceptance_by_position": position_rates(by_position),
        "lenient_tokens": sum(int(c.stats.get("lenient", 0)) for c in completions),  # > 0: BIASED samples
        "engine_steps": int(bm.get("engine_steps", 0)),
        "fed_tokens": int(bm.get("fed_tokens", 0)),
        "spec_off_steps": int(bm.get("spec_off_steps", 0)),
        "spec_off_fraction": float(bm["spec_off_fraction"]) if "spec_off_fraction" in bm else (
            bm.get("spec_off_steps", 0) / bm["engine_steps"] if bm.get("engine_steps") else 0.0),
        "tail_seconds": float(bm.get("tail_seconds", 0.0)),
        "worker_busy_fraction": float(bm.get("worker_busy_fraction", 1.0)),
        "drafter_accepted_share": accepted.get("drafter", 0) / tokens if tokens else 0.0,
        "drafter_train_steps": int(bm.get("drafter_train_steps", 0)),
        "drafter_version": int(bm.get("drafter_version", 0)),
        "reward_mean": None,
    }


def aggregate(steps: Sequence[dict]) -> dict:
    """Per-step aggregate of generate-call records: sums, and ratios recomputed from the sums."""
    out: dict = {k: 0 for k in SUM_KEYS}
    out["rollout_seconds"] = 0.0
    out["tail_seconds"] = 0.0
    out["proposed"] = sum_counts(s.get("proposed", {}) for s in steps)
    out["accepted"] = sum_counts(s.get("accepted", {}) for s in steps)
    out["by_position"] = add_positions({}, (s.get("by_position", {}) for s in steps))
    out["acceptance_by_position"] = position_rates(out["by_position"])
    busy, rewards, n_rewards = 0.0, 0.0, 0
    for s in steps:
        for k in SUM_KEYS:
            out[k] += s.get(k, 0)
        busy += s.get("worker_busy_fraction", 1.0) * s.get("rollout_seconds", 0.0)
        if s.get("reward_mean") is not None:
            rewards += s["reward_mean"] * s.get("num_requests", 1)
            n_rewards += s.get("num_requests", 1)
    secs = out["rollout_seconds"]
    out["tokens_per_second"] = out["generated_tokens"] / secs if secs > 0 else 0.0
    out["accepted_per_verify"] = (out["generated_tokens"] / (out["forward_passes"] + out["num_requests"])
                                  if out["num_requests"] else 0.0)
    out["spec_off_fraction"] = (out["spec_off_steps"] / out["engine_steps"] if out["engine_steps"]
                                else (steps[-1].get("spec_off_fraction", 0.0) if steps else 0.0))
    out["worker_busy_fraction"] = busy / secs if secs > 0 else 1.0
    out["drafter_accepted_share"] = (out["accepted"].get("drafter", 0) / out["generated_tokens"]
                                     if out["generated_tokens"] else 0.0)
    out["drafter_train_steps"] = sum(s.get("drafter_train_steps", 0) for s in steps)
    out["drafter_version"] = max((s.get("drafter_version", 0) for s in steps), default=0)
    out["reward_mean"] = rewards / n_rewards if n_rewards else None
    out["rollout_steps"] = len(steps)
    return out


def sum_counts(parts: Iterable[dict]) -> dict:
    """Per-name sums of {name: count} dicts."""
    total: dict = {}
    for part in parts:
        for name, v in part.items():
            total[name] = total.get(name, 0) + int(v)
    return total


def add_positions(total: dict, parts: Iterable[dict]) -> dict:
    """Sum per-position counters ({proposer: [offered per position, accepted per position]})."""
    for part in parts:
        for name, counts in part.items():
            mine = total.setdefault(name, [[], []])
            for acc, add in zip(mine, counts):
                acc.extend([0] * (len(add) - len(acc)))
                for i, v in enumerate(add):
                    acc[i] += int(v)
    return total


def position_rates(by_position: dict) -> dict:
    """Per proposer and draft position i: of the drafts that offered a token at i, the share whose
    tokens up to i were all accepted (vLLM's per-position acceptance, per draft that went so deep)."""
    return {name: [round(a / o, 4) if o else None for o, a in zip(offered, accepted + [0] * len(offered))]
            for name, (offered, accepted) in by_position.items()}


# ------------------------------------------------------------------------------ files


class MetricsLog:
    """metrics.jsonl in a folder, one JSON record per step. Each `append` rewrites the whole
    file atomically (the file holds a few hundred lines at most), so it is always complete.
    The file is first written at the end of the first step: a run that fails before then
    leaves an existing metrics.jsonl untouched."""

    def __init__(self, folder: str | os.PathLike, name: str = "metrics.jsonl"):
        self.path = os.path.join(os.fspath(folder), name)
        self.records: list[dict] = []

    def append(self, record: dict) -> None:
        self.records.append(record)
        atomic_write_text(self.path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in self.records))


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ------------------------------------------------------------------------------ the table

COLUMNS = (  # (header, width, record key, format)
    ("step", 5, "step", "{:d}"),
    ("reward", 6, "reward_mean", "{:.3f}"),
    ("roll_s", 7, "rollout_seconds", "{:.1f}"),
    ("tok/s", 7, "tokens_per_second", "{:.0f}"),
    ("tail_s", 6, "tail_seconds", "{:.1f}"),
    ("tok/fwd", 7, "accepted_per_verify", "{:.2f}"),
    ("reused", 7, "reused_tokens", "{:d}"),
    ("train_s", 7, "train_seconds", "{:.1f}"),
)
DRAFTER_COLUMNS = (  # shown when the online drafter is on
    ("drafter", 7, "drafter_accepted_share", "{:.0%}"),
    ("dr_tr_s", 7, "drafter_train_seconds", "{:.1f}"),
)
COMPARE_COLUMNS = (
    ("plain_s", 7, "plain_rollout_seconds", "{:.1f}"),
    ("speedup", 7, "speedup", "{:.2f}x"),
    ("same", 4, "tokens_identical", "{}"),
)


def _columns(compare: bool, drafter: bool):
    return COLUMNS + (DRAFTER_COLUMNS if drafter else ()) + (COMPARE_COLUMNS if compare else ())


def table_header(compare: bool = False, drafter: bool = False) -> str:
    return " ".join(h.rjust(w) for h, w, _, _ in _columns(compare, drafter))


def table_row(record: dict, compare: bool = False, drafter: bool = False) -> str:
    cells = []
    for _, w, key, fmt in _columns(compare, drafter):
        v = record.get(key)
        if isinstance(v, bool):
            text = "yes" if v else "NO"
        elif v is None:
            text = "-"
        else:
            text = fmt.format(v)
        cells.append(text.rjust(w))
    return " ".join(cells)


def rollout_digest(completion_ids: Sequence[Sequence[int]], rewards: Sequence[float]) -> str:
    """A step's tokens and rewards in one sha256: runs (a resumed one, another backend) compare by it."""
    h = hashlib.sha256()
    for ids, r in zip(completion_ids, rewards):
        h.update(json.dumps([list(ids), float(r)]).encode())
    return h.hexdigest()


def resident_mb() -> Optional[float]:
    """This process's resident memory now, in MiB (None where /proc is not there)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def mean(xs: Iterable[float]) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else 0.0
