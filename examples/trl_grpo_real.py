"""GRPO with TRL on real work: SmolLM2-135M-Instruct on a reasoning-gym task.

An ordinary TRL GRPO script: a data set of chat prompts built with reasoning_gym.create_dataset,
the data set's own score_answer as the reward, GRPOConfig, GRPOTrainer. `--generation spectail`
adds the one spectail line, `rollout_func=SpectailRollout(...)`; `--generation trl` leaves TRL's
own generation (transformers' generate). Either way every generation's rollout is timed where TRL
calls it (GRPOTrainer._generate: prompts in, completion ids out), printed, and written to
<output-dir>/rollouts.json; `--summarize` prints two runs side by side.

    python examples/trl_grpo_real.py --generation trl --output-dir runs/trl_real/trl
    python examples/trl_grpo_real.py --generation spectail --output-dir runs/trl_real/spectail
    python examples/trl_grpo_real.py --summarize runs/trl_real/trl/rollouts.json runs/trl_real/spectail/rollouts.json
    python examples/trl_grpo_real.py --generation spectail --check-exact   # also a plain engine: same tokens?

--model takes a Hugging Face folder of the policy; without it the script asks `spectail fetch
smollm2` for one (python -m rl_integration fetch smollm2).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout

from rl_integration.trl_rollout import SpectailRollout  # noqa: E402 -- also sets OpenMP's wait policy first

SYSTEM_PROMPT = ("Answer the question directly. Provide your answer between <answer> and </answer> tags. "
                 "Do not return any preamble, explanation, or reasoning.")  # reasoning_gym's "direct" prompt
TASK = "basic_arithmetic"
TASK_CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+", "-"],
               "allow_parentheses": False, "allow_negation": False}
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
MICRO_BATCH = 4  # completions per forward/backward: memory only (without checkpointing, activations grow with it)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--generation", choices=("trl", "spectail"), default="spectail",
                   help="who generates the rollouts: TRL's own generate, or spectail's engine")
    p.add_argument("--model", default=None, help="Hugging Face folder of the policy (default: spectail fetch smollm2)")
    p.add_argument("--task", default=TASK, help="a reasoning_gym data set name")
    p.add_argument("--task-config", type=json.loads, default=TASK_CONFIG,
                   help="the data set's keyword arguments, as JSON")
    p.add_argument("--size", type=int, default=64, help="problems in the data set")
    p.add_argument("--steps", type=int, default=3, help="generations (rollouts) to train for")
    p.add_argument("--prompts", type=int, default=8, help="prompts per generation")
    p.add_argument("--num-generations", type=int, default=8, help="completions per prompt (GRPO group)")
    p.add_argument("--max-completion-length", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="runs/trl_grpo_real")
    p.add_argument("--check-exact", action="store_true",
                   help="spectail only: every rollout again on a plain engine (no drafts); tokens must be equal "
                        "(its rollout seconds then include the plain engine's)")
    p.add_argument("--summarize", nargs="+", metavar="ROLLOUTS_JSON", help="print runs' rollouts.json side by side")
    return p.parse_args(argv)


def model_dir(model: str | None) -> str:
    """The policy's folder: --model, else what `spectail fetch smollm2` prints last."""
    if model:
        return model
    cmd = [sys.executable, "-m", "rl_integration", "fetch", "smollm2"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines or not os.path.isdir(lines[-1]):
        raise SystemExit(f"no policy folder: `{' '.join(cmd[1:])}` failed ({done.stderr.strip()[-300:]}); "
                         "pass --model DIR, a Hugging Face folder of SmolLM2-135M-Instruct")
    return lines[-1]


def build_task(name: str, size: int, seed: int, config: dict):
    """(TRL data set of chat prompts with an `index` column, reasoning_gym data set)."""
    import reasoning_gym
    from datasets import Dataset

    problems = reasoning_gym.create_dataset(name, size=size, seed=seed, **config)
    rows = [{"prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": e["question"]}],
             "index": i} for i, e in enumerate(problems)]
    return Dataset.from_list(rows), problems


def extract(text: str):
    """The answer in a completion: its last <answer>...</answer>, else its last number. The small
    model rarely writes the tags at first; without the fallback almost every reward is 0 and GRPO
    has no signal (the tags still win when present)."""
    try:
        from reasoning_gym.utils import extract_answer
    except ImportError:  # older reasoning_gym: the same rule
        found = re.findall(r"<answer>\s?(.*?)\s?</answer>", text, flags=re.DOTALL)
        tagged = found[-1].strip() if found else None
    else:
        tagged = extract_answer(text)
    if tagged is not None:
        return tagged
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None


def make_reward(problems):
    """TRL reward function: the data set's own score_answer on the extracted answer."""
    def task_score(completions, index, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(problems.score_answer(extract(t), problems[i])) for t, i in zip(texts, index)]
    return task_score


def grpo_config(args: argparse.Namespace):
    """Plain GRPO with small, on-policy steps: one optimizer step per generation over all its
    completions, no reuse of a generation (num_iterations=1), no KL term."""
    import torch
    from trl import GRPOConfig

    per_generation = args.prompts * args.num_generations
    micro = min(MICRO_BATCH, per_generation)  # memory only: the optimizer step sees the whole generation
    if per_generation % micro:
        raise SystemExit(f"--prompts x --num-generations ({per_generation}) must be a multiple of {micro}")
    return GRPOConfig(
        output_dir=args.output_dir, use_cpu=not torch.cuda.is_available(), bf16=False, seed=args.seed,
        report_to="none", learning_rate=args.lr, lr_scheduler_type="constant", beta=0.0, num_iterations=1,
        per_device_train_batch_size=micro, gradient_accumulation_steps=per_generation // micro,
        num_generations=args.num_generations, max_completion_length=args.max_completion_length,
        temperature=1.0, top_k=0, top_p=1.0, max_steps=args.steps, logging_steps=1, save_strategy="no",
        disable_tqdm=True, gradient_checkpointing=False,  # TRL's default recomputes every layer: slow on a CPU
    )


def spectail_rollout(trainer_args, dataset, tokenizer, plain: bool = False) -> SpectailRollout:
    """The rollout_func. Its KV cache is sized to the longest prompt plus a completion, not to the
    model's context (the cache is slots x max_model_len); plain: no drafts and no history."""
    longest = max(len(ids) for ids in tokenizer.apply_chat_template(
        list(dataset["prompt"]), add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    engine = {"max_model_len": longest + trainer_args.max_completion_length + 1}
    if not plain:
        return SpectailRollout({"engine": engine})
    return SpectailRollout({"engine": {**engine, "spec": None}, "history": {"enabled": False}}, echo=None)


def build_trainer(args: argparse.Namespace, model: str | None = None):
    """GRPOTrainer for args; model: an already resolved policy folder (default: model_dir(args.model))."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    if args.check_exact and args.generation != "spectail":
        raise SystemExit("--check-exact compares spectail's speculative tokens with its plain ones: "
                         "use it with --generation spectail")
    folder = model or model_dir(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    policy = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    dataset, problems = build_task(args.task, args.size, args.seed, args.task_config)
    config = grpo_config(args)
    rollout = None
    if args.generation == "spectail":
        rollout = spectail_rollout(config, dataset, tokenizer)
        if args.check_exact:
            rollout = ExactCheck(rollout, spectail_rollout(config, dataset, tokenizer, plain=True))
    trainer = GRPOTrainer(model=policy, processing_class=tokenizer, reward_funcs=make_reward(problems), args=config,
                          train_dataset=dataset, rollout_func=rollout)
    trainer._generate = RolloutTimer(trainer._generate)
    return trainer


class ExactCheck:
    """A rollout_func that runs two SpectailRollouts in step (the same run seed and rollout count,
    hence the same noise) and refuses to go on if their tokens differ."""

    def __init__(self, rollout: SpectailRollout, plain: SpectailRollout):
        self.rollout, self.plain, self.checked = rollout, plain, []

    def __call__(self, prompts, trainer) -> dict:
        out = self.rollout(prompts, trainer)
        ref = self.plain(prompts, trainer)
        differ = [i for i, (a, b) in enumerate(zip(out["completion_ids"], ref["completion_ids"])) if a != b]
        if differ or out["spectail_seed"] != ref["spectail_seed"]:
            raise RuntimeError(f"rollout {len(self.checked)}: completions {differ[:8]} differ from the plain engine's")
        self.checked.append(sum(map(len, out["completion_ids"])))
        print(f"exact: rollout {len(self.checked) - 1}: {len(out['completion_ids'])} completions, "
              f"{self.checked[-1]} tokens, identical to the plain engine's")
        return out


class RolloutTimer:
    """Wraps GRPOTrainer._generate, the one call both generation paths go through once per
    generation (tokenize, generate, decode): its wall seconds per call."""

    def __init__(self, generate):
        self.generate, self.seconds, self.tokens = generate, [], []

    def __call__(self, prompts):
        start = time.perf_counter()
        out = self.generate(prompts)
        self.seconds.append(time.perf_counter() - start)
        self.tokens.append(sum(len(ids) for ids in out[1]))  # completion_ids
        print(f"rollout {len(self.seconds) - 1}: {len(prompts)} completions, {self.tokens[-1]} tokens "
              f"in {self.seconds[-1]:.2f}s", flush=True)
        return out


def report(trainer, args: argparse.Namespace) -> dict:
    """Per generation: rollout seconds, tokens, reward; written to <output-dir>/rollouts.json."""
    timer = trainer._generate
    rewards = [r["reward"] for r in trainer.state.log_history if "reward" in r]
    record = {"generation": args.generation, "model": args.model, "task": args.task, "task_config": args.task_config,
              "prompts": args.prompts, "num_generations": args.num_generations,
              "max_completion_length": args.max_completion_length, "lr": args.lr,
              "rollout_seconds": timer.seconds, "completion_tokens": timer.tokens, "reward": rewards}
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "rollouts.json"), "w") as f:
        json.dump(record, f, indent=1)
    print("reward per generation:", " ".join(f"{r:.3f}" for r in rewards))
    return record


def summarize(paths: list[str]) -> str:
    """The runs' per-generation rollout seconds, side by side (one column pair per run)."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    head = "generation " + " ".join(f"{r['generation'] + ' s':>10} {'tokens':>7} {'tok/s':>6} {'reward':>6}"
                                    for r in runs)
    lines = [head]
    for step in range(max(len(r["rollout_seconds"]) for r in runs)):
        cells = []
        for r in runs:
            if step < len(r["rollout_seconds"]):
                secs, tokens = r["rollout_seconds"][step], r["completion_tokens"][step]
                reward = r["reward"][step] if step < len(r["reward"]) else float("nan")
                cells.append(f"{secs:>10.2f} {tokens:>7} {tokens / secs:>6.1f} {reward:>6.3f}")
            else:
                cells.append(" " * 32)
        lines.append(f"{step:>10} " + " ".join(cells))
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if args.summarize:
        print(summarize(args.summarize))
        return None
    trainer = build_trainer(args)
    trainer.train()
    report(trainer, args)
    return trainer


if __name__ == "__main__":
    main()
