"""Write the embedded addition task as a data set in verl's layout, then train on it:

    python examples/make_verl_parquet.py data/verl_train.parquet [--num-problems 64] [--seed 0]
    spectail train --config examples/grpo_verl.yaml

One row per prompt, as verl's own preprocessing writes its data sets (volcengine/verl,
examples/data_preprocess/gsm8k.py, `make_map_fn`): `data_source` names the scorer, `prompt` is a
list of chat messages, `reward_model.ground_truth` is the answer, `extra_info` goes to the scorer.
The same file trains with verl itself (data.train_files=...) given a scorer for its data_source.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from rl_integration.config import TaskConfig
from rl_integration.dataset import Problem, write_rows
from rl_integration.demo.task import make_problems

DATA_SOURCE = "spectail/addition"


def verl_row(problem: Problem, index: int, split: str) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": problem.prompt}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": problem.answer},
        "extra_info": {"split": split, "index": index, "question": problem.prompt},
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="the Parquet file to write (replaced atomically)")
    parser.add_argument("--num-problems", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split", default="train")
    args = parser.parse_args(argv)
    task = TaskConfig(num_problems=args.num_problems, seed=args.seed)
    write_rows([verl_row(p, i, args.split) for i, p in enumerate(make_problems(task))], args.path)
    print(f"wrote {args.num_problems} rows in verl's layout to {args.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
