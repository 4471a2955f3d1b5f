"""A warm start for any policy: the head trained on the policy's own samples, cached by its weights.

`load_or_warm_start_for(policy, prompts)`, called before a run's first step on a checkpoint
(rl_integration/online_drafter.py): the policy samples its own responses at T = 1 (plain
decoding), the draft vocabulary is their most frequent tokens (drafter/vocab.py), and the head
trains on them (drafter/warm_start.py), all within one time budget. The result is exported under
the spectail cache, never beside the user's checkpoint, named by a hash of the weights, the
head's config and the recipe: the same checkpoint and settings load it in seconds next time.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from rollout.core.model import CausalLM

from .export import export
from .features import SavedRollout
from .head import DraftHead, HeadConfig
from .trainer import TrainConfig
from .vocab import frequent_tokens
from .warm_start import load_cached, warm_start

RECIPE_FORMAT = 1  # bump when the recipe changes in a way the key's inputs do not show


@dataclasses.dataclass(frozen=True)
class Recipe:
    """samples: responses per prompt; time_budget_s: sampling (stopping after the wave that passes
    sample_share of it) and training; batch: requests per engine wave; seed: the samples' noise
    and the head's initial weights; max_steps: optimizer steps at most (None: the budget alone)."""

    samples: int = 4
    max_tokens: int = 192
    time_budget_s: float = 240.0
    sample_share: float = 0.5
    batch: int = 64
    seed: int = 0
    max_steps: Optional[int] = None

    def validate(self) -> None:
        if self.samples < 1 or self.max_tokens < 2 or self.batch < 1:
            raise ValueError(f"warm start recipe needs samples >= 1, max_tokens >= 2, batch >= 1: {self}")
        if not (self.time_budget_s > 0 and 0 < self.sample_share < 1):
            raise ValueError(f"warm start recipe needs time_budget_s > 0 and 0 < sample_share < 1: {self}")


def weights_digest(policy: CausalLM) -> str:
    """sha256 of the policy's parameters and buffers; a tied weight is read once."""
    h, seen = hashlib.sha256(), set()
    for name, t in sorted(policy.state_dict().items()):
        key = (t.data_ptr(), t.dtype, tuple(t.shape))
        if key in seen:
            h.update(f"{name}=tied\n".encode())
            continue
        seen.add(key)
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def cache_key(policy: CausalLM, prompts: Sequence[Sequence[int]], stop_token_ids: Sequence[int],
              head_config: HeadConfig, recipe: Recipe) -> str:
    """The cache entry's name: drafter-<hash of weights, head config, recipe, prompts, stops>."""
    text = json.dumps({"format": RECIPE_FORMAT, "weights": weights_digest(policy),
                       "head": dataclasses.asdict(head_config), "recipe": dataclasses.asdict(recipe),
                       "prompts": hashlib.sha256(json.dumps([list(map(int, p)) for p in prompts]).encode()).hexdigest(),
                       "stop": sorted(int(t) for t in stop_token_ids)}, sort_keys=True)
    return "drafter-" + hashlib.sha256(text.encode()).hexdigest()[:24]


def sample_own_rollouts(policy: CausalLM, prompts: Sequence[Sequence[int]], stop_token_ids: Sequence[int],
                        recipe: Recipe, seconds: float,
                        num_threads: Optional[int] = None) -> tuple[list[SavedRollout], list[Optional[torch.Tensor]]]:
    """The policy's own responses at T = 1, recipe.samples per prompt, in waves of recipe.batch,
    with the features the engine's forwards made (the drafter proposer collecting, with no head;
    None where none were kept). A wave starts only while the last one's time still fits `seconds`."""
    from rollout import Engine, EngineConfig, SamplingParams, SpecConfig
    from rollout.config import DrafterSpec
    from rollout.core.seeds import prompt_key, sample_seed

    from .proposer import DrafterProposer

    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("the drafter's warm start needs at least one prompt, and no empty prompt")
    requests = [(list(map(int, p)), sample_seed(recipe.seed, prompt_key(p), i, None))
                for p in prompts for i in range(recipe.samples)]
    params = SamplingParams(temperature=1.0, max_tokens=recipe.max_tokens, stop_token_ids=list(stop_token_ids))
    w = policy.lm_head.weight
    max_len = max(len(p) for p, _ in requests) + recipe.max_tokens
    spec = SpecConfig(proposers=("drafter",), drafter=DrafterSpec(collect=True, buffer_tokens=len(requests) * max_len))
    engine = Engine(policy, EngineConfig(
        max_batch_size=min(recipe.batch, len(requests)), max_model_len=max_len,
        dtype=str(w.dtype).removeprefix("torch."), device=str(w.device), num_threads=num_threads, spec=spec))
    buffer = DrafterProposer.of(engine).buffer
    start, last, out = time.perf_counter(), 0.0, []
    for i in range(0, len(requests), recipe.batch):
        t0 = time.perf_counter()
        if out and t0 - start + last > seconds:
            break
        wave = requests[i:i + recipe.batch]
        done = engine.generate([p for p, _ in wave], params, seeds=[s for _, s in wave])
        out += [SavedRollout(p, c.token_ids, c.seed) for (p, _), c in zip(wave, done)]
        last = time.perf_counter() - t0
    feats = [None if (e := buffer.get(r.seed)) is None or e.sample.token_ids != r.token_ids else e.features
             for r in out]
    return out, feats


def load_or_warm_start_for(policy: CausalLM, prompts: Sequence[Sequence[int]], stop_token_ids: Sequence[int] = (),
                           head_config: HeadConfig = HeadConfig(), recipe: Recipe = Recipe(),
                           train_config: TrainConfig = TrainConfig(decay="cosine"), cache_dir: Optional[str] = None,
                           num_threads: Optional[int] = None,
                           progress: bool = False) -> tuple[DraftHead, Path, dict]:
    """The draft head for this policy warm-started on its own samples of these prompts (token ids),
    from the spectail cache when there. head_config.draft_vocab: the draft vocabulary's size.
    Returns (head, its folder, report); report["cached"] says whether it was loaded."""
    recipe.validate()
    head_config.resolved(policy.cfg)  # a bad config fails before any work
    root = Path(cache_dir or os.environ.get("SPECTAIL_CACHE") or Path.home() / ".cache" / "spectail")
    folder = root / cache_key(policy, prompts, stop_token_ids, head_config, recipe)
    cached = load_cached(folder, policy)
    if cached is not None:
        return cached, folder, {"cached": True}
    if progress:
        print(f"spectail: warm-starting the draft head on the policy's own samples -> {folder}", flush=True)
    t0 = time.perf_counter()
    rollouts, features = sample_own_rollouts(policy, prompts, stop_token_ids, recipe,
                                             recipe.sample_share * recipe.time_budget_s, num_threads)
    sample_seconds = time.perf_counter() - t0
    head = DraftHead.for_policy(policy, head_config, dtype=torch.float32, seed=recipe.seed)
    if head.draft_vocab is not None:
        head.set_draft_vocab(frequent_tokens([r.response_ids for r in rollouts], head_config.draft_vocab,
                                             policy.cfg.vocab_size))
    if num_threads is not None:
        train_config = dataclasses.replace(train_config, num_threads=num_threads)
    budget = max(0.1 * recipe.time_budget_s, recipe.time_budget_s - (time.perf_counter() - t0))
    head, _, report = warm_start(policy, rollouts, train_config=train_config, time_budget_s=budget,
                                 max_steps=recipe.max_steps, head=head, seed=recipe.seed, features=features)
    export(head, folder)
    report.update(cached=False, sample_seconds=sample_seconds,
                  response_tokens=sum(len(r.response_ids) for r in rollouts))
    return head, folder, report
