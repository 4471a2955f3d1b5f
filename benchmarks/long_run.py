"""A long GRPO run on the real workload: memory stays flat, and a SIGKILL plus `--resume auto`
give the very same tokens and rewards as the uninterrupted run.

    python -m benchmarks.long_run [--steps 50] [--kill-at 23] [--out bench_results/real/long_run] [key=value ...]

Two runs of `spectail train --config examples/grpo_real.yaml` with a checkpoint every
--save-every steps, side by side: A runs uninterrupted; B is killed with SIGKILL while it rolls out step
--kill-at, then resumed with `--resume auto` and run to the end. Every step's metrics record
carries `rollout_sha256` (the step's tokens and rewards) and `memory_rss_mb`: the steps' digests
of A and B must be equal, and A's resident memory after step 2 must stay within --memory-slack
of its value there. Writes long_run.json and prints one verdict line.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.long_run", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=os.path.join(ROOT, "examples", "grpo_real.yaml"))
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--kill-at", type=int, default=23, help="B is killed while rolling out this step")
    p.add_argument("--memory-slack", type=float, default=0.05, help="allowed growth of resident memory after step 2")
    p.add_argument("--out", default="bench_results/real/long_run")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    return p.parse_args(argv)


def command(args, out: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "rl_integration", "train", "--config", args.config, *args.overrides,
            f"trainer.steps={args.steps}", f"trainer.save_every={args.save_every}", "output.plot=false",
            "--quiet", "--out", out, *extra]


def records(out: str) -> list[dict]:
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def run(cmd: list[str], log: str) -> int:
    with open(log, "a", encoding="utf-8") as f:
        return subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode


def killed_run(args, out: str, log: str) -> None:
    """B: started, killed (SIGKILL) once step --kill-at's rollout is under way, resumed to the end."""
    with open(log, "a", encoding="utf-8") as f:
        proc = subprocess.Popen(command(args, out), cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        while proc.poll() is None and len(records(out)) < args.kill_at:
            time.sleep(0.5)
        time.sleep(2.0)  # into step kill_at's rollout
        if proc.poll() is not None:
            raise SystemExit(f"run B ended (exit {proc.returncode}) before step {args.kill_at}: see {log}")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    print(f"B killed in step {len(records(out))}; resuming", flush=True)
    code = run(command(args, out, "--resume", "auto"), log)
    if code != 0:
        raise SystemExit(f"the resumed run B failed (exit {code}): see {log}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    a, b = os.path.join(args.out, "a"), os.path.join(args.out, "b")
    log = os.path.join(args.out, "long_run.log")
    load = os.getloadavg()
    # A and B run side by side (each given its own cores by the overrides, say one torch thread
    # each on two cores): their tokens do not depend on the time they take
    a_proc = None
    if len(records(a)) < args.steps:
        a_log = open(os.path.join(args.out, "long_run_a.log"), "a", encoding="utf-8")
        a_proc = subprocess.Popen(command(args, a, "--resume", "auto"), cwd=ROOT, stdout=a_log,
                                  stderr=subprocess.STDOUT)
    killed_run(args, b, log)
    if a_proc is not None and a_proc.wait() != 0:
        raise SystemExit(f"run A failed (exit {a_proc.returncode}): see {args.out}/long_run_a.log")
    ra, rb = records(a), records(b)
    same = [x["rollout_sha256"] == y["rollout_sha256"] for x, y in zip(ra, rb)]
    memory = [r.get("memory_rss_mb") for r in ra]
    base = memory[2] if len(memory) > 2 else None
    growth = (max(m for m in memory[2:]) - base) / base if base else None
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_before": load,
              "load_after": os.getloadavg(), "steps": args.steps, "kill_at": args.kill_at,
              "overrides": args.overrides, "identical_steps": sum(same), "compared_steps": len(same),
              "memory_rss_mb": memory, "memory_growth_after_step_2": growth,
              "reward_mean": [r.get("reward_mean") for r in ra]}
    with open(os.path.join(args.out, "long_run.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    flat = growth is not None and growth <= args.memory_slack
    print(f"long run: {len(ra)} steps; resumed run identical in {sum(same)}/{len(same)} steps; memory after step 2 "
          f"{'flat' if flat else 'GREW'} ({(growth or 0) * 100:+.1f}%)")
    if not (all(same) and len(same) == args.steps and flat):
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
