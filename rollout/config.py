"""User-facing configuration of the engine: what to sample and how to run. Each bad value is
rejected, naming its field, before any state of the engine is touched."""
from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import ClassVar, Optional, Sequence

import torch


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. Every token is argmax(z/T + Gumbel(seed, t, v)) over the kept tokens."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = keep all
    max_tokens: int = 256
    stop_token_ids: Sequence[int] = ()

    def validate(self, vocab_size: int | None = None) -> None:
        t = _real(self.temperature, "temperature")
        # outside this z / T leaves float32 (NaN logprobs) or flattens to uniform
        need(t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE, "SamplingParams.temperature",
             f"must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]", self.temperature)
        need(0.0 < _real(self.top_p, "top_p") <= 1.0, "SamplingParams.top_p", "must be in (0, 1]", self.top_p)
        need(_integer(self.top_k, "top_k") >= 0, "SamplingParams.top_k", "must be an integer >= 0 (0 = off)",
             self.top_k)
        need(_integer(self.max_tokens, "max_tokens") >= 1, "SamplingParams.max_tokens", "must be an integer >= 1",
             self.max_tokens)
        need(isinstance(self.stop_token_ids, Iterable) and not isinstance(self.stop_token_ids, (str, bytes)),
             "SamplingParams.stop_token_ids", "must be a sequence of token ids", self.stop_token_ids)
        for tok in self.stop_token_ids:
            if vocab_size is not None and not (0 <= _integer(tok, "stop_token_ids") < vocab_size):
                raise ValueError(f"SamplingParams.stop_token_ids has {tok}, outside the vocabulary [0, {vocab_size})")


MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-4, 1e4


def _real(value, name: str) -> float:
    """A finite real number (not a bool, a string or NaN), or a ValueError naming the field."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"SamplingParams.{name} must be a finite number, got {value!r}")
    return float(value)


def _integer(value, name: str) -> int:
    """An integer (Python, NumPy or 0-d tensor; not a bool or a float), or a ValueError naming it."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise ValueError(f"SamplingParams.{name} must be an integer, got {value!r}") from None


def need(ok: bool, name: str, msg: str, value) -> None:
    """A ValueError "<name> <msg>, got <value>" unless ok: every config's check, naming the field."""
    if not ok:
        raise ValueError(f"{name} {msg}, got {value!r}")


def is_int(value, low: int = 1, none: bool = False) -> bool:
    """value is an int >= low (not a bool), or None where none allows it."""
    return (none and value is None) or (isinstance(value, int) and not isinstance(value, bool) and value >= low)


def is_device(name) -> bool:
    """name names a torch device ('cpu', 'cuda', 'cuda:1', ...)."""
    try:
        torch.device(name)
    except (RuntimeError, TypeError):
        return False
    return True


@dataclass(frozen=True)
class DrafterSpec:
    """The online drafter's settings, once (the "drafter" proposer's, its warm start's and training's):
    SpecConfig.drafter, set in a run config as rollout.drafter (docs/configuration.md).

    enabled: a run adds "drafter" to the engine's proposers. path: an exported head to start
        from; None: a run's warm start (trained within warm_start_s, drafting over draft_vocab
        tokens), an engine's none until `set_head`. A head that does not fit switches it off.
    kind, window, intermediate_size, num_heads, num_kv_heads (None: the policy's): a fresh head's.
    lr, ttt_steps, reward_beta: its training; between_steps_s (local backend, 0: none) and
        idle_slice_s (a Ray worker with no chunk, None: none): when it trains.
    collect, buffer_tokens: hand responses and hidden states to a training buffer of this size.
    """

    enabled: bool = False
    path: Optional[str] = None
    kind: str = "attention"
    window: Optional[int] = 64
    intermediate_size: Optional[int] = None
    num_heads: Optional[int] = None
    num_kv_heads: Optional[int] = None
    warm_start_s: float = 300.0
    draft_vocab: Optional[int] = 8192
    lr: float = 1e-3
    ttt_steps: int = 3
    reward_beta: float = 0.0
    between_steps_s: float = 5.0
    idle_slice_s: Optional[float] = 1.0
    collect: bool = True
    buffer_tokens: int = 200_000

    MOVED: ClassVar[dict] = {"train": "rollout.drafter"}  # a run config's old rollout.drafter.train.*

    def layer(self) -> dict:
        """A fresh head's layer sizes, as drafter.head.HeadConfig keywords."""
        return {"intermediate_size": self.intermediate_size, "num_heads": self.num_heads,
                "num_kv_heads": self.num_kv_heads}

    def validate(self) -> None:
        for name, v in self.layer().items():
            need(is_int(v, none=True), f"DrafterSpec.{name}", "must be None (the policy's) or an integer >= 1", v)
        need(not (self.num_heads and self.num_kv_heads) or self.num_heads % self.num_kv_heads == 0,
             "DrafterSpec.num_heads", f"must be a multiple of num_kv_heads ({self.num_kv_heads})", self.num_heads)
        need(self.path is None or isinstance(self.path, str), "DrafterSpec.path", "must be a folder or None", self.path)
        need(self.kind in ("attention", "mlp"), "DrafterSpec.kind", "must be 'attention' or 'mlp'", self.kind)
        need(is_int(self.window, none=True), "DrafterSpec.window", "must be None (all rows) or an integer >= 1",
             self.window)
        need(is_int(self.draft_vocab, none=True), "DrafterSpec.draft_vocab",
             "must be None (the whole vocabulary) or an integer >= 1", self.draft_vocab)
        for name in ("warm_start_s", "reward_beta", "between_steps_s"):
            need(getattr(self, name) >= 0, f"DrafterSpec.{name}", "must be >= 0", getattr(self, name))
        need(self.lr > 0, "DrafterSpec.lr", "must be > 0", self.lr)
        need(is_int(self.ttt_steps), "DrafterSpec.ttt_steps", "must be an integer >= 1", self.ttt_steps)
        need(self.idle_slice_s is None or self.idle_slice_s > 0, "DrafterSpec.idle_slice_s",
             "must be None (no slices) or > 0", self.idle_slice_s)
        need(is_int(self.buffer_tokens), "DrafterSpec.buffer_tokens", "must be an integer >= 1", self.buffer_tokens)


# Draft sources by name, as "module:Class" (rollout/proposers/__init__.py imports them): here, so
# that checking a SpecConfig imports no proposer.
PROPOSERS = {
    "ngram": "rollout.proposers.ngram:NgramProposer",
    "history": "rollout.proposers.history:HistoryProposer",
    "suffix": "rollout.proposers.suffix:SuffixProposer",
    "lookahead": "rollout.proposers.lookahead:LookaheadProposer",
    "drafter": "drafter.proposer:DrafterProposer",
}


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding. Drafts never change the output, only how many forwards it takes.

    proposers: the draft sources, in order of preference on ties.
    max_draft_tokens: the most draft tokens verified per request per step (k).
    max_batch_for_spec: no drafts while more requests than this run (None: always speculate).
    ngram_sizes: n-gram lengths the prompt-lookup proposer tries.
    min_draft_prob: None prices draft tokens by the step-cost table (rollout/budget/budget.py); a number
        drafts every token whose chance to land is at least min_draft_prob x the share of slots used.
    step_cost: None measures it once per machine and model shape, cached; or {"tokens": [...],
        "seconds": [...], "per_attended": s, "per_attended_draft": s, "per_row": s} (rollout/budget/step_cost.py).
    lenience: EXPERIMENTAL. None (exact) or l >= 1: SPEC-RL's lenient acceptance (rollout/core/lenient.py)
        of a history token whose new probability is at least 1/l of its old one. BIASED: outputs
        are no longer exact samples; stats["lenient"] counts what it accepted.
    drafter: the "drafter" proposer's settings (DrafterSpec).
    """

    proposers: tuple[str, ...] = ("ngram",)
    max_draft_tokens: int = 8
    max_batch_for_spec: Optional[int] = None
    ngram_sizes: tuple[int, ...] = (3, 2, 1)
    min_draft_prob: Optional[float] = None
    step_cost: Optional[dict] = None
    lenience: Optional[float] = None
    drafter: DrafterSpec = DrafterSpec()

    MOVED: ClassVar[dict] = {"drafter": "rollout.drafter"}  # a run config's one drafter section

    def validate(self) -> None:
        unknown = [p for p in self.proposers if p not in PROPOSERS]
        need(not unknown, "SpecConfig.proposers", f"has unknown {unknown}; known: {list(PROPOSERS)}", self.proposers)
        need(len(set(self.proposers)) == len(self.proposers), "SpecConfig.proposers", "lists a proposer twice",
             self.proposers)
        need(bool(self.proposers), "SpecConfig.proposers", "is empty; use spec=None to turn speculation off",
             self.proposers)
        need(self.max_draft_tokens >= 1, "SpecConfig.max_draft_tokens", "must be >= 1", self.max_draft_tokens)
        need(self.max_batch_for_spec is None or self.max_batch_for_spec >= 0, "SpecConfig.max_batch_for_spec",
             "must be >= 0 or None", self.max_batch_for_spec)
        need(self.min_draft_prob is None or 0.0 <= self.min_draft_prob < 1.0, "SpecConfig.min_draft_prob",
             "must be None (by device) or in [0, 1)", self.min_draft_prob)
        if self.step_cost is not None:
            from .budget.step_cost import StepCost

            StepCost.from_dict(self.step_cost)
        need(self.lenience is None or self.lenience >= 1.0, "SpecConfig.lenience", "must be None (exact) or >= 1",
             self.lenience)
        need(bool(self.ngram_sizes) and min(self.ngram_sizes) >= 1, "SpecConfig.ngram_sizes",
             "must be positive integers", self.ngram_sizes)
        need(isinstance(self.drafter, DrafterSpec), "SpecConfig.drafter", "must be a DrafterSpec", self.drafter)
        self.drafter.validate()


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs: slots, lengths, precision, device, speculation.

    max_batch_size: KV-cache slots; at most this many requests run at once.
    max_model_len: prompt + response tokens per request.
    max_num_batched_tokens: tokens per forward; long prompts are prefilled in chunks of this.
    num_threads: torch threads on a CPU; None: by model size and free cores (rollout/core/threads.py).
    kept_slots: extra KV slots that keep paused requests' KV between runs (rollout/core/kept_slots.py).
    share_prompts: requests with the same prompt running at once compute it once (a GRPO group's
        samples; rollout/core/prompt_share.py). Tokens are the same either way.
    """

    max_batch_size: int = 64
    max_model_len: int = 2048
    max_num_batched_tokens: int = 2048
    dtype: str = "float32"
    device: str = "cpu"
    spec: Optional[SpecConfig] = None
    num_threads: Optional[int] = None
    kept_slots: int = 0
    share_prompts: bool = True

    def validate(self) -> None:
        need(self.max_batch_size >= 1, "EngineConfig.max_batch_size", "must be >= 1", self.max_batch_size)
        need(self.max_model_len >= 2, "EngineConfig.max_model_len", "must be >= 2", self.max_model_len)
        need(self.max_num_batched_tokens >= 1, "EngineConfig.max_num_batched_tokens", "must be >= 1",
             self.max_num_batched_tokens)
        need(is_device(self.device), "EngineConfig.device", "must name a torch device ('cpu', 'cuda', 'cuda:1', ...)",
             self.device)
        need(is_int(self.num_threads, none=True), "EngineConfig.num_threads",
             "must be None (by model size) or an integer >= 1", self.num_threads)
        need(is_int(self.kept_slots, low=0), "EngineConfig.kept_slots", "must be an integer >= 0", self.kept_slots)
        need(isinstance(self.share_prompts, bool), "EngineConfig.share_prompts", "must be true or false",
             self.share_prompts)
        torch_dtype(self.dtype)
        if self.spec is not None:
            self.spec.validate()


_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


@dataclass
class Completion:
    """One finished request; logprobs: of token_ids under the processed (T, top-k, top-p) distribution."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    seed: int
    stats: dict = field(default_factory=dict)
