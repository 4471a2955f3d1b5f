"""The online drafter (planned): a small head trained on the policy's own rollouts, on workers
the long tail leaves idle. Not built yet; see DESIGN.md."""
import rollout  # noqa: F401 -- first: it sets OpenMP's wait policy before torch loads (rollout/threads.py)
