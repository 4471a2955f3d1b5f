"""The rollout-backend contract, and its in-process implementation. Local, Ray
(scheduler.ray_backend) and vLLM (rollout.vllm_backend) backends all fulfil it, so RolloutClient
and the trainer adapters never ask which one they hold."""
from __future__ import annotations

import math
import time
from typing import Optional, Protocol, Sequence, runtime_checkable

from .config import Completion, EngineConfig, SamplingParams
from .core.engine import Engine


@runtime_checkable
class RolloutBackend(Protocol):
    def generate(self, prompt_token_ids: Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams], seeds: Optional[Sequence[int]] = None,
                 drafts=None, groups=None, draft_logprobs=None) -> list[Completion]:
        """Engine.generate's contract: one Completion per prompt, in order."""

    def update_weights(self, weights) -> None:
        """Load the trainer's weights (Engine.update_weights' forms), all or nothing (ValueError)."""

    def metrics(self) -> dict:
        """Figures of the last generate: rollout_seconds, tail_seconds, engine_steps, ..."""

    def shutdown(self) -> None:
        """Release what the backend holds (workers, a local Ray)."""


def tail_seconds(finish_times: Sequence[float], fraction: float = 0.9) -> float:
    """Time from when `fraction` of the samples had finished to when all had."""
    if not finish_times:
        return 0.0
    t = sorted(finish_times)
    return t[-1] - t[max(0, math.ceil(fraction * len(t)) - 1)]


class LocalBackend:
    """One Engine in this process, timing when each request finished (tail_seconds, a progress bar)."""

    def __init__(self, model, engine_config: EngineConfig, progress: bool = False, desc: str = "rollout"):
        self.engine = Engine.from_pretrained(model, engine_config)
        self.progress, self.desc = progress, desc
        self._metrics: dict = {}

    def generate(self, prompt_token_ids, sampling_params=SamplingParams(), seeds=None, drafts=None, groups=None,
                 draft_logprobs=None) -> list[Completion]:
        finished: list[float] = []
        bar = None
        if self.progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(prompt_token_ids), desc=self.desc, unit="sample", leave=False, disable=None)
        start = time.perf_counter()

        def on_finish(_req) -> None:
            finished.append(time.perf_counter() - start)
            if bar is not None:
                bar.update(1)

        try:
            outs = self.engine.generate(prompt_token_ids, sampling_params, seeds, drafts, groups, draft_logprobs,
                                        on_finish=on_finish)
        finally:
            if bar is not None:
                bar.close()
        run = self.engine.last_run
        self._metrics = {"rollout_seconds": time.perf_counter() - start, "tail_seconds": tail_seconds(finished),
                         "engine_steps": run.steps, "spec_off_steps": run.spec_off_steps,
                         "fed_tokens": run.fed_tokens, "worker_busy_fraction": 1.0}
        return outs

    def update_weights(self, weights) -> None:
        self.engine.update_weights(weights)

    def metrics(self) -> dict:
        return dict(self._metrics)

    def shutdown(self) -> None:
        pass
