"""`python -m rl_integration train --config FILE [key=value ...]` is `spectail train ...`: the
form a Ray job's entrypoint takes (the console script may not be on a cluster node's PATH).

    ray job submit --working-dir . -- python -m rl_integration train --config examples/grpo_parquet.yaml
"""
import sys

from rl_integration.cli import main

if __name__ == "__main__":
    sys.exit(main())
