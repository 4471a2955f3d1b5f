"""The "local" rollout backend: one in-process Engine behind the interface the Ray backend
has (generate / update_weights / last_metrics / shutdown), plus what only an in-process engine
can measure: when each request finished (for tail_seconds, and a tqdm bar) and how many engine
steps ran without speculation.
"""
from __future__ import annotations

import time

from rollout import Engine
from rollout.engine import to_completion

from .metrics import tail_seconds


class LocalBackend:
    def __init__(self, model, engine_config, progress: bool = False, desc: str = "rollout"):
        self.engine = Engine.from_pretrained(model, engine_config)
        self.progress = progress
        self.desc = desc
        self.last_metrics: dict = {}

    def generate(self, prompt_ids, params, seeds, drafts=None, groups=None, draft_logprobs=None):
        requests = self.engine.make_requests(prompt_ids, params, seeds, drafts, groups,
                                             draft_logprobs=draft_logprobs)
        finished: list[float] = []
        bar = None
        if self.progress:
            from tqdm.auto import tqdm
            # disable=None: off when not a terminal
            bar = tqdm(total=len(requests), desc=self.desc, unit="sample", leave=False, disable=None)
        start = time.perf_counter()

        def on_finish(req):
            finished.append(time.perf_counter() - start)
            if bar is not None:
                bar.update(1)

        try:
            self.engine.run(requests, on_finish=on_finish)
        finally:
            if bar is not None:
                bar.close()
            self.engine.release_groups({g for g in groups or () if g is not None})
        self.last_metrics = {"finish_times": finished, "tail_seconds": tail_seconds(finished),
                             "engine_steps": self.engine.steps, "spec_off_steps": self.engine.spec_off_steps,
                             "worker_busy_fraction": 1.0}
        return [to_completion(r) for r in requests]

    def update_weights(self, weights) -> int:
        return self.engine.update_weights(weights)

    def shutdown(self) -> None:
        pass
