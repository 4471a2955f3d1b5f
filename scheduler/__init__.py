"""Everything distributed: workers, the rollout scheduler, and the rollout history store."""
from .history_store import HistoryRecord, HistoryStore, prompt_key

__all__ = ["HistoryRecord", "HistoryStore", "prompt_key"]
