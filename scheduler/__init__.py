"""Everything distributed: workers, the rollout scheduler, and the rollout history store."""

from .history_store import HistoryRecord, HistoryStore
from .ray_backend import RayRolloutBackend
from .rollout_scheduler import MODES, RolloutScheduler, SchedulerConfig
from .worker import RolloutWorker

__all__ = ["HistoryRecord", "HistoryStore", "RayRolloutBackend", "RolloutScheduler",
           "SchedulerConfig", "RolloutWorker", "MODES"]
