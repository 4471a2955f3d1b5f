"""The Ray worker: one engine per actor, running chunks of a divided rollout.

A worker keeps nothing between chunks that the output depends on. Every token is a pure
function of (weights, prompt, seed, position), so a work item carries the whole state of its
request -- prompt, output so far, seed, sampling params, draft -- and any worker holding the
same weights continues it with the same tokens. What a worker does keep is only speed: the
proposers' indexes (a GRPO group's suffix index grows while its members run here).

`RolloutWorker` is a plain class; the backend wraps it with `ray.remote` and the resources it
was given, so this module imports without Ray.

A work item (dict):
    id              the scheduler's request id (returned as is)
    prompt_ids      list[int]
    output_ids      tokens generated so far (continue from there)
    logprobs        their logprobs (len(output_ids) floats)
    seed            int in [0, 2**63)
    params          SamplingParams
    draft           a previous response for the "history" proposer, or None
    draft_logprobs  its old logprobs (the drafts' confidence; the lenient mode compares them), or None
    stats           the request's counters so far: forward_passes, proposed, accepted, lenient
                    (the per-sample stats; they are returned updated)
    group           GRPO group id (hashable) or None
    rollout         id of the rollout the item belongs to (groups are scoped by it)
    max_new_tokens  the chunk: pause after this many new tokens (None = run to the end)

A result (dict): id; token_ids and logprobs (the tokens generated in this call only);
finish_reason ("stop" | "length", or None when paused at the end of the chunk); stats (the
counters, cumulative); finished_at_s (seconds from the start of
the call to this request's last token, None if paused); for the whole call (same in every
result): wall_s, engine_steps (target forwards), spec_off_steps (those without drafts) and
fed_tokens (tokens fed to them, prefill included) -- the work the call took, independent of
how busy the machine was.
"""
from __future__ import annotations

import os
import socket
import time
from typing import Any, Optional

import torch
from torch import nn

from rollout import Engine, EngineConfig


class _Checkpoint(nn.Module):
    """A (Hugging Face config, state dict) pair, shaped like the in-memory transformers model
    `Engine.from_pretrained` accepts (it reads `.config` and `.state_dict()`)."""

    def __init__(self, config, tensors: dict):
        super().__init__()
        self.config = config
        self._tensors = tensors

    def state_dict(self, *args, **kwargs):  # noqa: D102 -- the pair's tensors, as given
        return self._tensors


def as_engine_model(source):
    """What a worker receives as its model source, as something Engine.from_pretrained loads:
    a checkpoint folder path (str), or a (Hugging Face config, state dict) pair."""
    if isinstance(source, (str, os.PathLike)):
        return os.fspath(source)
    if isinstance(source, tuple) and len(source) == 2 and isinstance(source[1], dict):
        return _Checkpoint(source[0], source[1])
    if isinstance(source, nn.Module) and hasattr(source, "config"):
        return source
    raise ValueError("a model source must be a checkpoint folder path, a (Hugging Face config, "
                     f"state dict) pair or a transformers model, got {type(source).__name__}")


STAT_FIELDS = ("forward_passes", "proposed", "accepted", "lenient")


def get_stats(req) -> dict:
    """A request's counters (those of its fields that exist), copied."""
    return {f: (dict(v) if isinstance(v, dict) else v) for f in STAT_FIELDS
            if (v := getattr(req, f, None)) is not None}


def set_stats(req, stats: dict) -> None:
    for f, v in stats.items():
        if hasattr(req, f):
            setattr(req, f, dict(v) if isinstance(v, dict) else v)


class RolloutWorker:
    """An engine behind a Ray actor. Created by the backend with
    `ray.remote(RolloutWorker).options(num_cpus=..., num_gpus=...)`."""

    def __init__(self, source, engine_config: EngineConfig, index: int = 0,
                 num_threads: Optional[int] = None):
        if num_threads:
            torch.set_num_threads(int(num_threads))
        self.index = index
        self.engine = Engine.from_pretrained(as_engine_model(source), engine_config)
        self._rollout_groups: dict[Any, set] = {}  # rollout id -> group keys indexed here
        self.busy_s = 0.0
        self.chunks = 0
        self._steps = self._fed = 0  # engine forwards and tokens fed to them: work, not time
        self._spec_off = 0  # forwards without drafts (the engine counts them per run)
        self.engine.model.register_forward_hook(self._count_forward)

    def _count_forward(self, module, args, output) -> None:
        self._steps += 1
        ids = getattr(args[0], "token_ids", None) if args else None
        self._fed += int(ids.numel()) if ids is not None else 0

    def ping(self) -> dict:
        cfg = self.engine.config
        return {"index": self.index, "pid": os.getpid(), "host": socket.gethostname(),
                "vocab_size": self.engine.vocab_size, "max_batch_size": cfg.max_batch_size,
                "max_model_len": cfg.max_model_len, "device": cfg.device,
                "num_threads": torch.get_num_threads(), "busy_s": self.busy_s, "chunks": self.chunks}

    def update_weights(self, weights) -> int:
        """weights: a state dict (Ray resolves the ObjectRef the backend passes). All or nothing."""
        return self.engine.update_weights(weights)

    def run_chunk(self, work: list[dict]) -> list[dict]:
        t0 = time.perf_counter()
        steps0, fed0, off0 = self._steps, self._fed, self._spec_off
        self._forget_other_rollouts({w.get("rollout") for w in work})
        by_budget: dict[Optional[int], list[dict]] = {}
        for w in work:
            by_budget.setdefault(w.get("max_new_tokens"), []).append(w)
        results = []
        for budget, items in by_budget.items():  # the scheduler sends one budget per batch
            results += self._run(items, budget, t0)
        wall = time.perf_counter() - t0
        for r in results:
            r.update(wall_s=wall, engine_steps=self._steps - steps0, fed_tokens=self._fed - fed0,
                     spec_off_steps=self._spec_off - off0)
        self.busy_s += wall
        self.chunks += 1
        return results

    # ---- internals ---------------------------------------------------------------------------

    def _run(self, items: list[dict], budget: Optional[int], t0: float) -> list[dict]:
        for w in items:
            if len(w.get("logprobs") or ()) != len(w.get("output_ids") or ()):
                raise ValueError(f"work item {w.get('id')}: {len(w.get('logprobs') or ())} logprobs "
                                 f"for {len(w.get('output_ids') or ())} output tokens")
        reqs = self.engine.make_requests(
            [w["prompt_ids"] for w in items], [w["params"] for w in items],
            seeds=[w["seed"] for w in items], drafts=[w.get("draft") for w in items],
            groups=[self._group_key(w) for w in items],
            outputs=[list(w.get("output_ids") or ()) for w in items],
            draft_logprobs=[w.get("draft_logprobs") for w in items])
        starts = []
        for r, w in zip(reqs, items):
            r.logprobs = [float(x) for x in (w.get("logprobs") or ())]  # the engine fills NaN
            set_stats(r, w.get("stats") or {})
            starts.append(len(r.output_ids))
        finished_at: dict[int, float] = {}
        self.engine.run(reqs, max_new_tokens=budget,
                        on_finish=lambda r: finished_at.__setitem__(id(r), time.perf_counter() - t0))
        self._spec_off += self.engine.spec_off_steps
        out = []
        for r, w, n0 in zip(reqs, items, starts):
            done_s = finished_at.get(id(r), 0.0) if r.finish_reason else None
            out.append({"id": w["id"], "token_ids": r.output_ids[n0:], "logprobs": r.logprobs[n0:],
                        "finish_reason": r.finish_reason, "stats": get_stats(r), "finished_at_s": done_s})
        return out

    def _group_key(self, w: dict):
        g = w.get("group")
        if g is None:
            return None
        rollout = w.get("rollout")
        if rollout is None:
            return g
        self._rollout_groups.setdefault(rollout, set()).add((rollout, g))
        return (rollout, g)  # group ids are only unique within one rollout

    def _forget_other_rollouts(self, current: set) -> None:
        """Drop the suffix indexes of groups of earlier rollouts (their prompts are done)."""
        for rollout in [r for r in self._rollout_groups if r not in current]:
            self.engine.release_groups(self._rollout_groups.pop(rollout))
