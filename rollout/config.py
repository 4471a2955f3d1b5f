"""User-facing configuration of the engine: what to sample and how to run.

Validation lives next to the fields so every bad value is rejected with a message
that names the field, before any state of the engine is touched.
"""
from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Optional, Sequence

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
        if not (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):
            # outside this z / T leaves float32 (NaN logprobs) or flattens to uniform
            raise ValueError(f"SamplingParams.temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, "
                             f"{MAX_TEMPERATURE}], got {self.temperature}")
        if not (0.0 < _real(self.top_p, "top_p") <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if _integer(self.top_k, "top_k") < 0:
            raise ValueError(f"SamplingParams.top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if _integer(self.max_tokens, "max_tokens") < 1:
            raise ValueError(f"SamplingParams.max_tokens must be an integer >= 1, got {self.max_tokens}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids, Iterable):
            raise ValueError(f"SamplingParams.stop_token_ids must be a sequence of token ids, "
                             f"got {self.stop_token_ids!r}")
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


@dataclass(frozen=True)
class DrafterSpec:
    """The "drafter" proposer (drafter/proposer.py): where its head comes from, what it keeps.

    path: a folder written by `drafter.export` to load the head from; None: no head until one is
        set in-process (`drafter.proposer.DrafterProposer.of(engine).set_head(head, version)`,
        as the online trainer does). A head that does not fit the policy switches the drafter
        off with a warning; the other proposers keep working.
    collect: keep every request's hidden states and hand finished (and paused) responses to the
        proposer's training buffer (drafter/buffer.py).
    buffer_tokens: that buffer's budget, prompt + response tokens.
    max_positions: draft positions per step at most (None: max_draft_tokens).
    kind, window: a fresh head's kind ("attention" | "mlp") and attention window (None: all
        rows) when one is trained without a path.
    intermediate_size, num_heads, num_kv_heads: that fresh head's decoder layer (None: the
        policy's), wherever it is trained (in-process, or on a Ray worker's idle slice).
    idle_slice_s: on Ray, a worker with no chunk while a rollout runs trains the head in slices
        of this many seconds (None: it does not); lr, ttt_steps: that training's (drafter/online.py).
    """

    path: Optional[str] = None
    collect: bool = True
    buffer_tokens: int = 200_000
    max_positions: Optional[int] = None
    kind: str = "attention"
    window: Optional[int] = None
    idle_slice_s: Optional[float] = None
    lr: float = 1e-3
    ttt_steps: int = 3
    intermediate_size: Optional[int] = None
    num_heads: Optional[int] = None
    num_kv_heads: Optional[int] = None

    def layer(self) -> dict:
        """A fresh head's layer sizes, as drafter.head.HeadConfig keywords."""
        return {"intermediate_size": self.intermediate_size, "num_heads": self.num_heads,
                "num_kv_heads": self.num_kv_heads}

    def validate(self) -> None:
        for name, v in self.layer().items():
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"DrafterSpec.{name} must be None (the policy's) or an integer >= 1, got {v!r}")
        if self.num_heads and self.num_kv_heads and self.num_heads % self.num_kv_heads:
            raise ValueError(f"DrafterSpec.num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.path is not None and not isinstance(self.path, str):
            raise ValueError(f"DrafterSpec.path must be a folder path or None, got {self.path!r}")
        if not (isinstance(self.buffer_tokens, int) and self.buffer_tokens >= 1):
            raise ValueError(f"DrafterSpec.buffer_tokens must be an integer >= 1, got {self.buffer_tokens!r}")
        if self.max_positions is not None and not (isinstance(self.max_positions, int) and self.max_positions >= 1):
            raise ValueError(f"DrafterSpec.max_positions must be None or an integer >= 1, got {self.max_positions!r}")
        if self.window is not None and not (isinstance(self.window, int) and self.window >= 1):
            raise ValueError(f"DrafterSpec.window must be None or an integer >= 1, got {self.window!r}")
        if self.kind not in ("attention", "mlp"):
            raise ValueError(f"DrafterSpec.kind must be 'attention' or 'mlp', got {self.kind!r}")
        if self.idle_slice_s is not None and not self.idle_slice_s > 0:
            raise ValueError(f"DrafterSpec.idle_slice_s must be None or > 0, got {self.idle_slice_s!r}")
        if not self.lr > 0 or not (isinstance(self.ttt_steps, int) and self.ttt_steps >= 1):
            raise ValueError(f"DrafterSpec needs lr > 0 and an integer ttt_steps >= 1, got {self.lr}, {self.ttt_steps}")


# Draft sources by name, as "module:Class": rollout/proposers/__init__.py imports a class only when
# a SpecConfig names it. Kept here so that checking a SpecConfig imports no proposer (they import
# request.py, which imports this module).
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

    proposers: which draft sources to consult, in order of preference on ties.
    max_draft_tokens: the most draft tokens verified per request per step (k).
    max_batch_for_spec: when more requests than this are running, the step is compute-bound
        and drafts are skipped (None = always speculate).
    ngram_sizes: n-gram lengths tried by the prompt-lookup proposer, longest first.
    min_draft_prob: None (the default) prices each draft token by the step-cost table: tokens are
        drafted, the likeliest to land first, while each raises the step's emitted tokens per
        second (rollout/budget.py): deep where a fed token is nearly free (small batches, the
        tail), none where drafts miss. A number instead drafts every token whose chance of being
        reached and accepted is at least min_draft_prob x the fraction of slots in use (0 always
        drafts max_draft_tokens). Either way the drafts depend only on what the run accepted.
    step_cost: None (the default) measures the cost of a forward by fed tokens once per device,
        model shape, dtype and thread count, at the first priced run, and caches it under
        $SPECTAIL_CACHE (else ~/.cache/spectail)/step_cost; or a table {"tokens": [...],
        "seconds": [...], "per_attended": s}: seconds of a forward feeding that many tokens, and
        seconds per context token their attention reads.
    lenience: None (exact, the default) or l >= 1: SPEC-RL's lenient acceptance. A history
        draft token that differs from the exact sample is still accepted when its new
        probability is at least 1/l of its old one. BIASED: outputs are no longer exact
        samples of the policy; every completion it touched says so in stats["lenient"].
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

    def validate(self) -> None:
        unknown = [p for p in self.proposers if p not in PROPOSERS]
        if unknown:
            raise ValueError(f"SpecConfig.proposers has unknown {unknown}; known: {list(PROPOSERS)}")
        if len(set(self.proposers)) != len(self.proposers):
            raise ValueError(f"SpecConfig.proposers lists a proposer twice: {list(self.proposers)}")
        if not self.proposers:
            raise ValueError("SpecConfig.proposers is empty; use spec=None to turn speculation off")
        if self.max_draft_tokens < 1:
            raise ValueError(f"SpecConfig.max_draft_tokens must be >= 1, got {self.max_draft_tokens}")
        if self.max_batch_for_spec is not None and self.max_batch_for_spec < 0:
            raise ValueError(f"SpecConfig.max_batch_for_spec must be >= 0 or None, got {self.max_batch_for_spec}")
        if self.min_draft_prob is not None and not 0.0 <= self.min_draft_prob < 1.0:
            raise ValueError(f"SpecConfig.min_draft_prob must be None (by device) or in [0, 1), "
                             f"got {self.min_draft_prob}")
        if self.step_cost is not None:
            from .step_cost import StepCost

            StepCost.from_dict(self.step_cost)
        if self.lenience is not None and not self.lenience >= 1.0:
            raise ValueError(f"SpecConfig.lenience must be None (exact) or >= 1, got {self.lenience}")
        if not self.ngram_sizes or min(self.ngram_sizes) < 1:
            raise ValueError(f"SpecConfig.ngram_sizes must be positive integers, got {self.ngram_sizes}")
        if not isinstance(self.drafter, DrafterSpec):
            raise ValueError(f"SpecConfig.drafter must be a DrafterSpec, got {self.drafter!r}")
        self.drafter.validate()


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs: slots, lengths, precision, device, speculation.

    max_batch_size: KV-cache slots; at most this many requests run at once.
    max_model_len: prompt + response tokens per request.
    max_num_batched_tokens: tokens per forward; long prompts are prefilled in chunks of this.
    num_threads: torch intra-op threads while the engine runs on a CPU; None picks them by model
        size and the cores this process may use (rollout/threads.py).
    kept_slots: KV slots beyond max_batch_size that hold paused requests' KV between runs, so a
        request continued on the same engine is not prefilled again (rollout/kept_slots.py; the
        Ray workers of a divided rollout use them); 0 keeps none.
    """

    max_batch_size: int = 64
    max_model_len: int = 2048
    max_num_batched_tokens: int = 2048
    dtype: str = "float32"
    device: str = "cpu"
    spec: Optional[SpecConfig] = None
    num_threads: Optional[int] = None
    kept_slots: int = 0

    def validate(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"EngineConfig.max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_model_len < 2:
            raise ValueError(f"EngineConfig.max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"EngineConfig.max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError):
            raise ValueError(f"EngineConfig.device must name a torch device ('cpu', 'cuda', 'cuda:1', ...), "
                             f"got {self.device!r}") from None
        if self.num_threads is not None and not (isinstance(self.num_threads, int) and self.num_threads >= 1):
            raise ValueError(f"EngineConfig.num_threads must be None (by model size) or an integer >= 1, "
                             f"got {self.num_threads!r}")
        if isinstance(self.kept_slots, bool) or not (isinstance(self.kept_slots, int) and self.kept_slots >= 0):
            raise ValueError(f"EngineConfig.kept_slots must be an integer >= 0, got {self.kept_slots!r}")
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
    """One finished request. logprobs are float32 log-probabilities of token_ids under the
    processed (temperature, top-k, top-p) target distribution."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    seed: int
    stats: dict = field(default_factory=dict)
