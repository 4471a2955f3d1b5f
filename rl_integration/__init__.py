"""What users touch: the RolloutClient facade, GRPO and PPO trainers, the embedded task, run
configs, metrics and plots, and the `spectail` command line (rl_integration.cli)."""
import rollout  # noqa: F401 -- first: it sets OpenMP's wait policy before torch loads (rollout/threads.py)

from .config import RunConfig, TaskConfig, load_config
from .dataset import Problem, load_parquet_dataset, save_parquet_dataset
from .demo.task import make_problems, reward_fn
from .grpo import GRPOTrainer, clipped_policy_loss, group_advantages, k3_kl, masked_aggregate
from .ppo import PPOTrainer, clipped_value_loss, gae, token_rewards
from .rollout_client import RolloutBatch, RolloutClient
from .trainer import RewardError, train

__all__ = [
    "RolloutClient", "RolloutBatch",
    "RunConfig", "load_config", "train", "RewardError",
    "GRPOTrainer", "group_advantages", "clipped_policy_loss", "k3_kl", "masked_aggregate",
    "PPOTrainer", "gae", "token_rewards", "clipped_value_loss",
    "TaskConfig", "Problem", "make_problems", "reward_fn", "load_parquet_dataset", "save_parquet_dataset",
]
