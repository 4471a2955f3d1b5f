"""`python -m rl_integration.train --config FILE [key=value ...] [--compare]`: the same run as
`spectail train`, as a module, so a Ray job can use it as its entrypoint:

    ray job submit --working-dir . -- python -m rl_integration.train --config examples/grpo_parquet.yaml \
        rollout.backend=ray rollout.num_workers=4
"""
from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
