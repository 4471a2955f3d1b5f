"""GRPO with TRL on spectail's embedded task (add two numbers by counting on), on the CPU.

An ordinary TRL GRPO script: a data set with a `prompt` column, a reward function, GRPOConfig,
GRPOTrainer. Its only spectail line is `rollout_func=SpectailRollout(...)`; the rest is the demo's
task and tiny warm-started policy (trained and cached on first use, about a minute).

    python examples/trl_grpo.py                     # 20 generations, prints per-step rollout metrics
    python examples/trl_grpo.py --steps 4 --set task.embedded.max_count=8
    python examples/trl_grpo.py --generation trl    # TRL's own generation in place of spectail's

--set takes spectail config overrides (`spectail demo` keys) for the task and the policy.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from rollout import cpu  # noqa: E402

cpu.configure()  # this script's process: passive OpenMP waiting before torch loads (rollout/cpu.py)

from rl_integration.trl_rollout import SpectailRollout  # noqa: E402


def embedded_demo(overrides: list[str]):
    """(model, tokenizer, problems, reward_fn) of spectail's embedded demo: the one place this
    script touches the demo's modules."""
    from rl_integration.config import load_config
    from rl_integration.demo.task import make_problems, reward_fn
    from rl_integration.trainer import load_policy

    cfg = load_config(None, overrides)
    model, tokenizer, _ = load_policy(cfg, progress=True)
    return model, tokenizer, make_problems(cfg.task.embedded), reward_fn


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--generation", choices=("trl", "spectail"), default="spectail",
                   help="who generates the rollouts: TRL's own generate, or spectail's engine")
    p.add_argument("--steps", type=int, default=20, help="generations (rollouts) to train for")
    p.add_argument("--prompts", type=int, default=8, help="prompts per generation")
    p.add_argument("--num-generations", type=int, default=16, help="completions per prompt (GRPO group)")
    p.add_argument("--max-completion-length", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--num-iterations", type=int, default=1, help="optimizer passes over each generation")
    p.add_argument("--batch-size", type=int, default=32, help="completions per optimizer step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="runs/trl_grpo")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="spectail demo overrides")
    return p.parse_args(argv)


def build_trainer(args: argparse.Namespace):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    model, tokenizer, problems, reward_fn = embedded_demo(args.set)
    dataset = Dataset.from_list([{"prompt": p.prompt, "answer": p.answer} for p in problems])

    def correct_answer(completions, answer, **kwargs):
        return [reward_fn(text, truth) for text, truth in zip(completions, answer)]

    # Small on-policy steps: at lr 1e-3 with two passes over each generation (8 Adam steps per
    # rollout) the reward fell from the first generation on, with TRL's own generation as well.
    batch = args.batch_size
    per_generation = args.prompts * args.num_generations
    config = GRPOConfig(
        output_dir=args.output_dir, use_cpu=True, bf16=False, seed=args.seed, report_to="none",
        learning_rate=args.lr, lr_scheduler_type="constant", beta=0.0, num_iterations=args.num_iterations,
        per_device_train_batch_size=batch, steps_per_generation=max(1, per_generation // batch),
        num_generations=args.num_generations, max_completion_length=args.max_completion_length,
        temperature=1.0, max_steps=args.steps * args.num_iterations * max(1, per_generation // batch),
        logging_steps=1, save_strategy="no", disable_tqdm=True,
    )
    return GRPOTrainer(
        model=model, processing_class=tokenizer, reward_funcs=correct_answer, args=config, train_dataset=dataset,
        rollout_func=SpectailRollout() if args.generation == "spectail" else None,
    )


def main(argv=None):
    args = parse_args(argv)
    trainer = build_trainer(args)
    trainer.train()
    rewards = [r["reward"] for r in trainer.state.log_history if "reward" in r]
    print("reward per generation:", " ".join(f"{r:.3f}" for r in rewards))
    return trainer


if __name__ == "__main__":
    main()
