"""Test-only: run the `spectail` command line in this process, SIGKILL it at a chosen point, and
record what every step sampled. Production code has no fault hooks; this wraps its functions
from the outside before the run starts.

    python -m tests.rl_integration.kill_points [--kill POINT:STEP] --record FILE -- train --config ...
    code = run_forked([... the same arguments ...], log="run.log")   # the same, without the imports' cost

POINT, at step STEP (0-based) of the run:
    rollout     the rollout: local, once half of its requests have finished (the engine's
                on_finish); Ray, once the first chunk has come back to the driver
    optimizer   the optimizer updates: right after the first AdamW step (weights half-trained)
    history     writing the step's history file: its temporary file written, not yet in place
    metrics     writing metrics.jsonl after the step: the temporary file written, not yet in place
    checkpoint  writing the checkpoint after the step: every piece written, no manifest yet
    prune       the checkpoint after the step is in place; an old one is being deleted (renamed
                aside, not yet removed)
The record file gets one JSON line per rollout (step, completion token ids, rewards), appended
as it happens, so a killed run's lines are there too.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys

from rollout import cpu

cpu.configure()  # first, as the command line does: OpenMP's wait policy is set before torch loads

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# what a run imports, loaded once by the fork server (after cpu.configure(), above)
PRELOAD = ["rollout", "torch", "transformers", "transformers.models.llama.modeling_llama", "safetensors.torch",
           "pyarrow.parquet", "yaml", "tqdm.auto", "rl_integration.cli", "rl_integration.trainer",
           "rl_integration.grpo", "rl_integration.ppo", "rl_integration.demo.policy", "scheduler.history_store",
           "tests.rl_integration.kill_points"]
POINTS = ("rollout", "optimizer", "history", "metrics", "checkpoint", "prune")
_now = {"step": None}  # the step the run is in (set when its rollout starts)


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def install(point: str, step: int) -> None:
    """Arm one kill point (module docstring)."""
    if point not in POINTS:
        raise ValueError(f"kill point must be one of {POINTS}, got {point!r}")
    {"rollout": _rollout, "optimizer": _optimizer, "history": _history, "metrics": _metrics,
     "checkpoint": _checkpoint, "prune": _prune}[point](lambda: _now["step"] == step)


def track_and_record(path: str) -> None:
    """Follow the current step; append each rollout's tokens and rewards to `path`."""
    from rl_integration.rollout_client import RolloutClient

    generate, record_rewards = RolloutClient.generate, RolloutClient.record_rewards

    def tracked(self, prompts, n=None, *, step=None, keys=None):
        _now["step"] = self.step if step is None else step
        return generate(self, prompts, n, step=step, keys=keys)

    def recorded(self, batch, rewards):
        record_rewards(self, batch, rewards)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": batch.step, "tokens": batch.completion_ids, "rewards": batch.rewards,
                                "pid": os.getpid()}) + "\n")

    RolloutClient.generate, RolloutClient.record_rewards = tracked, recorded


def _rollout(armed) -> None:
    from rollout.core.engine import Engine
    from scheduler.rollout_scheduler import RolloutScheduler

    generate, receive = Engine.generate, RolloutScheduler._receive

    def engine_generate(self, prompts, *args, on_finish=None, **kwargs):
        if not armed():
            return generate(self, prompts, *args, on_finish=on_finish, **kwargs)
        finished = []

        def then_die(req):
            if on_finish is not None:
                on_finish(req)
            finished.append(req)
            if len(finished) >= len(prompts) // 2:
                die()
        return generate(self, prompts, *args, on_finish=then_die, **kwargs)

    def scheduler_receive(self, *args, **kwargs):
        out = receive(self, *args, **kwargs)
        if armed():
            die()
        return out

    Engine.generate, RolloutScheduler._receive = engine_generate, scheduler_receive


def _optimizer(armed) -> None:
    import torch

    step = torch.optim.AdamW.step

    def then_die(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        if armed():
            die()
        return out

    torch.optim.AdamW.step = then_die


def _history(armed) -> None:
    from scheduler import history_store

    atomic_path = history_store.atomic_path

    @contextlib.contextmanager
    def then_die(path):
        with atomic_path(path) as tmp:
            yield tmp
            if armed():
                die()  # inside atomic_path: the temporary is written, the rename has not happened

    history_store.atomic_path = then_die


def _metrics(armed) -> None:
    from rl_integration import metrics
    from scheduler.atomic_file import atomic_path

    write = metrics.atomic_write_text

    def then_die(path, text):
        if armed() and os.fspath(path).endswith("metrics.jsonl"):
            with atomic_path(path) as tmp:
                with open(tmp, "w", encoding="utf-8") as f:
                    f.write(text)
                die()
        write(path, text)

    metrics.atomic_write_text = then_die


def _checkpoint(armed) -> None:
    from rl_integration import checkpoint

    write_manifest = checkpoint._write_manifest

    def then_die(folder, step):
        if armed():
            die()
        write_manifest(folder, step)

    checkpoint._write_manifest = then_die


class _RmtreeThenDie:
    """checkpoint.py's `shutil`, whose rmtree of a folder renamed aside for deletion kills first."""

    def __init__(self, armed):
        self.armed = armed

    def __getattr__(self, name):
        return getattr(shutil, name)

    def rmtree(self, path, *args, **kwargs):
        if self.armed() and ".gone" in os.fspath(path):
            die()
        shutil.rmtree(path, *args, **kwargs)


def _prune(armed) -> None:
    from rl_integration import checkpoint

    checkpoint.shutil = _RmtreeThenDie(armed)


def run_forked(argv: list, log: str) -> int:
    """main(argv) in a child process, its stdout and stderr appended to `log`; returns its exit
    code (-9 when a kill point fired). The child forks from multiprocessing's fork server, which
    imported PRELOAD once and never ran a torch operation (so no OpenMP pool is forked): a fresh
    process as `python -m` would start, without its seconds of imports."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts (the first call)
    child = ctx.Process(target=_forked_main, args=(list(argv), os.fspath(log)))
    child.start()
    child.join()
    return child.exitcode


def _forked_main(argv: list, log: str) -> None:
    os.chdir(ROOT)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.exit(main(argv))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kill_points")
    parser.add_argument("--kill", help="POINT:STEP")
    parser.add_argument("--record", required=True)
    parser.add_argument("spectail", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    track_and_record(args.record)
    if args.kill:
        point, _, step = args.kill.partition(":")
        install(point, int(step))
    from rl_integration.cli import main as spectail

    rest = args.spectail[1:] if args.spectail[:1] == ["--"] else args.spectail
    return spectail(rest)


if __name__ == "__main__":
    sys.exit(main())
