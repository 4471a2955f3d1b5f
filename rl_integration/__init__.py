"""What users touch: the RolloutClient facade, GRPO and PPO trainers, the embedded task, run
configs, metrics and plots, and the `spectail` command line (rl_integration.cli).

Importing `rl_integration` loads nothing else (not torch), so the command line can configure the
process first (rollout/cpu.py). The names below load on first use."""
from __future__ import annotations

from rollout.lazy import lazy_exports

_EXPORTS = {
    "RolloutClient": ".rollout_client", "RolloutBatch": ".rollout_client",
    "RunConfig": ".config", "TaskConfig": ".config", "load_config": ".config",
    "train": ".trainer", "RewardError": ".trainer",
    "GRPOTrainer": ".grpo", "group_advantages": ".grpo", "clipped_policy_loss": ".grpo", "k3_kl": ".grpo",
    "masked_aggregate": ".grpo",
    "PPOTrainer": ".ppo", "gae": ".ppo", "token_rewards": ".ppo", "clipped_value_loss": ".ppo",
    "Problem": ".dataset", "load_parquet_dataset": ".dataset", "save_parquet_dataset": ".dataset",
    "make_problems": ".demo.task", "reward_fn": ".demo.task",
}
__all__ = list(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
