"""The whole run's configuration: nested dataclasses, loaded from YAML, with dotted overrides.

    cfg = load_config("examples/demo.yaml", ["trainer.epochs=3", "rollout.spec.max_draft_tokens=16"])

The dataclass defaults ARE the embedded demo (`spectail demo` runs `RunConfig()`), and
examples/demo.yaml spells the same values out (a test keeps the two equal), so the demo needs
no file shipped as package data.

Every key is checked against the dataclass fields and every value against the field's type
before anything runs: an unknown key or a wrong type raises ValueError naming the dotted key
(and the expected type, or the known keys). `validate()` then checks ranges and choices.
Override values are parsed as YAML (`3` is an int, `null` is None, `[a, b]` a list). Setting a
key under a section that is null (say `rollout.spec.max_draft_tokens=16` when `spec: null`)
brings the section back with its defaults; `rollout.spec=null` turns speculation off.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Sequence, Union

import yaml

from .policy import PolicyConfig
from .task import TaskConfig

# Draft sources the engine can build today (rollout.proposers.make_proposers); "drafter" is
# known to SpecConfig but not built yet.
AVAILABLE_PROPOSERS = ("history", "suffix", "lookahead", "ngram")

# ------------------------------------------------------------------------------ the sections


@dataclass
class ParquetSource:
    """A data set on disk: one row per prompt, the ground truth in `answer_key`."""

    path: str = ""
    prompt_key: str = "prompt"
    answer_key: str = "answer"


@dataclass
class TaskSection:
    """source: "embedded" (generated addition problems, `embedded` = TaskConfig) or
    "parquet" (`parquet.path`). reward: "embedded" (rl_integration.task.reward_fn) or
    "package.module:function", called as fn(response_text, answer) -> float."""

    source: Literal["embedded", "parquet"] = "embedded"
    embedded: TaskConfig = field(default_factory=lambda: TaskConfig(num_problems=64, seed=0))
    parquet: ParquetSource = field(default_factory=ParquetSource)
    reward: str = "embedded"


@dataclass
class PolicySection:
    """source: "embedded" (the tiny policy, SFT warm start cached under cache_dir) or
    "checkpoint" (a local Hugging Face folder with model and tokenizer)."""

    source: Literal["embedded", "checkpoint"] = "embedded"
    embedded: PolicyConfig = field(default_factory=PolicyConfig)
    checkpoint: str = ""
    cache_dir: Optional[str] = None  # None: $SPECTAIL_CACHE, else ~/.cache/spectail


@dataclass
class SpecSection:
    """Speculation (rollout.config.SpecConfig). Drafts never change the tokens, only speed."""

    # history + suffix + lookahead: in the demo, n-gram (prompt lookup) drafts cost more forward
    # work than they save at epoch 0 and add nothing once history exists; add "ngram" for
    # copy-heavy tasks
    proposers: list[str] = field(default_factory=lambda: ["history", "suffix", "lookahead"])
    max_draft_tokens: int = 24
    max_batch_for_spec: Optional[int] = None  # more requests running than this: no drafts
    ngram_sizes: list[int] = field(default_factory=lambda: [3, 2, 1])
    # adaptive budget: draft a token only if likely to be accepted; null: by device (0.3 CPU, 0.05 GPU)
    min_draft_prob: Optional[float] = None


@dataclass
class HistorySection:
    """History reuse: last epoch's response to (prompt, sample index) drafts this epoch's.
    Used when enabled and "history" is among spec.proposers."""

    enabled: bool = True
    dir: Optional[str] = None  # None: <output.dir>/history
    keep_epochs: int = 2


@dataclass
class RolloutSection:
    backend: Literal["local", "ray"] = "local"
    num_workers: int = 1  # ray only
    max_batch_size: int = 64
    max_model_len: int = 1024
    max_num_batched_tokens: int = 2048
    dtype: str = "float32"
    device: str = "cpu"
    num_threads: Optional[int] = None  # the engine's torch threads (null: by model size, rollout/threads.py)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 512
    n: int = 8  # samples per prompt (a GRPO group)
    noise: Literal["per_sample", "per_epoch"] = "per_epoch"  # per_sample: faster, biased (README)
    seed: Optional[int] = None  # the sampling noise's seed (None: trainer.seed)
    spec: Optional[SpecSection] = field(default_factory=SpecSection)
    history: HistorySection = field(default_factory=HistorySection)
    lenient: Optional[float] = None  # SPEC-RL lenience l >= 1; BIASED, off (null) by default
    chunk_tokens: Optional[int] = None  # ray only: divided rollout chunk size (null: its default)
    num_cpus_per_worker: float = 1.0
    num_gpus_per_worker: float = 0.0
    ray_address: Optional[str] = None  # None: $RAY_ADDRESS or a local Ray


@dataclass
class PPOSection:
    vf_coef: float = 0.5  # weight of the value loss
    value_clip_eps: float = 0.2  # value predictions move at most this far from the rollout's
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True
    value_trains_trunk: bool = False  # False: the value loss trains the head only


@dataclass
class TrainerSection:
    algorithm: Literal["grpo", "ppo"] = "grpo"
    epochs: int = 5
    prompts_per_epoch: int = 64
    lr: float = 1e-4
    weight_decay: float = 0.0
    clip_eps: float = 0.2
    clip_eps_high: Optional[float] = None  # None: = clip_eps (DAPO's clip-higher sets it larger)
    kl_coef: float = 0.0  # > 0 keeps a frozen copy of the initial policy as reference
    loss_agg: Literal["token_mean", "seq_mean"] = "token_mean"
    scale_rewards: bool = True  # GRPO: divide by the group's reward std (False: Dr. GRPO)
    adv_eps: float = 1e-4
    update_epochs: int = 1  # passes over each rollout
    minibatch_size: int = 32  # samples per optimizer step (0: the whole rollout)
    micro_batch_size: int = 16  # samples per forward/backward (memory only)
    max_grad_norm: float = 1.0
    seed: int = 0  # seeds sampling noise, prompt order and minibatch order
    device: str = "cpu"
    num_threads: Optional[int] = None  # torch threads for the optimizer steps (null: every usable core)
    ppo: PPOSection = field(default_factory=PPOSection)


@dataclass
class OutputSection:
    dir: str = "runs/demo"
    compare: bool = False  # also run the plain engine each epoch: speedup and identity check
    plot: bool = True
    progress: bool = True  # tqdm bars


@dataclass
class RunConfig:
    task: TaskSection = field(default_factory=TaskSection)
    policy: PolicySection = field(default_factory=PolicySection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    output: OutputSection = field(default_factory=OutputSection)


# ------------------------------------------------------------------------------ loading

_FLOAT_RE = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def load_config(path: Optional[Union[str, os.PathLike]] = None, overrides: Sequence[str] = ()) -> RunConfig:
    """RunConfig from a YAML file (None: the demo defaults) plus `key.sub=value` overrides."""
    raw: Any = {}
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                raw = yaml.safe_load(f)
        except FileNotFoundError:
            raise ValueError(f"config file {os.fspath(path)!r} does not exist") from None
        except yaml.YAMLError as e:
            raise ValueError(f"config file {os.fspath(path)!r} is not valid YAML: {e}") from None
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ValueError(f"config file {os.fspath(path)!r} must hold a mapping of sections, "
                             f"got {type(raw).__name__}")
    for item in overrides:
        apply_override(raw, item)
    cfg = from_dict(RunConfig, raw)
    validate(cfg)
    return cfg


def apply_override(raw: dict, item: str) -> None:
    """Set `a.b.c=value` in the raw mapping (value parsed as YAML)."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ValueError(f"override {item!r} must look like section.key=value")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as e:
        raise ValueError(f"override {item!r}: the value is not valid YAML: {e}") from None
    node, parts = raw, key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:  # absent, or a null section being brought back
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ValueError(f"override {item!r}: {'.'.join(parts[:i + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def from_dict(cls, data: Any, prefix: str = ""):
    """Build dataclass `cls` from a mapping, checking keys and types; missing keys keep defaults."""
    where = prefix or "the config"
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ValueError(f"config key {where!r} must be a mapping (section {cls.__name__}), "
                         f"got {type(data).__name__} {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in data:
        if key not in fields:
            dotted = f"{prefix}.{key}" if prefix else str(key)
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"unknown config key {dotted!r}{hint}; known keys under {where}: {sorted(fields)}")
    kwargs = {}
    for name, value in data.items():
        dotted = f"{prefix}.{name}" if prefix else name
        kwargs[name] = _convert(hints[name], value, dotted)
    return cls(**kwargs)


def _convert(tp, value, key: str):
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            if value is None:
                raise ValueError(f"config key {key!r}: expected {type_name(tp)}, got null")
            return _convert(inner[0], value, key)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key)
    if origin is Literal:
        if value not in args or isinstance(value, bool):
            raise ValueError(f"config key {key!r}: expected one of {list(args)}, got {value!r}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _FLOAT_RE.match(value.strip()):
            return float(value)  # PyYAML (YAML 1.1) reads 3e-4 as a string: still a float here
    elif tp is str:
        if isinstance(value, str):
            return value
    elif origin in (list, tuple):
        if isinstance(value, (list, tuple)):
            elem = args[0] if args else Any
            items = [_convert(elem, v, f"{key}[{i}]") for i, v in enumerate(value)]
            return tuple(items) if origin is tuple else items
    elif tp is Any:
        return value
    raise ValueError(f"config key {key!r}: expected {type_name(tp)}, got {type(value).__name__} {value!r}")


def type_name(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        inner = [type_name(a) for a in args if a is not type(None)]
        return " or ".join(inner) + (" or null" if type(None) in args else "")
    if origin is Literal:
        return f"one of {list(args)}"
    if origin in (list, tuple):
        return f"a list of {type_name(args[0])}" if args else "a list"
    if dataclasses.is_dataclass(tp):
        return f"a mapping ({tp.__name__})"
    return getattr(tp, "__name__", str(tp))


def to_dict(cfg) -> dict:
    """Plain nested dict (lists for tuples), e.g. to save the resolved config as YAML."""
    def plain(v):
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v
    return plain(cfg)


# ------------------------------------------------------------------------------ checking


def validate(cfg: RunConfig) -> None:
    """Ranges and cross-field rules, each error naming its dotted key. Types are already checked."""
    def need(ok: bool, key: str, msg: str, value) -> None:
        if not ok:
            raise ValueError(f"config key {key!r} {msg}, got {value!r}")

    t, p, r, tr, o = cfg.task, cfg.policy, cfg.rollout, cfg.trainer, cfg.output
    if t.source == "parquet":
        need(bool(t.parquet.path), "task.parquet.path", "must name a Parquet file when task.source is 'parquet'",
             t.parquet.path)
    else:
        _wrap(t.embedded.validate, "task.embedded")
    need(t.reward == "embedded" or ":" in t.reward, "task.reward",
         "must be 'embedded' or 'package.module:function'", t.reward)
    if p.source == "checkpoint":
        need(bool(p.checkpoint), "policy.checkpoint", "must name a local model folder when policy.source is "
             "'checkpoint'", p.checkpoint)
    else:
        _wrap(p.embedded.validate, "policy.embedded")

    need(r.n >= 1, "rollout.n", "must be >= 1 (samples per prompt)", r.n)
    need(r.num_workers >= 1, "rollout.num_workers", "must be >= 1", r.num_workers)
    need(r.max_batch_size >= 1, "rollout.max_batch_size", "must be >= 1", r.max_batch_size)
    need(r.max_tokens >= 1, "rollout.max_tokens", "must be >= 1", r.max_tokens)
    need(r.temperature > 0, "rollout.temperature", "must be > 0 for RL (T = 0 has no exploration and its "
         "logprobs are not the sampling distribution's)", r.temperature)
    need(0 < r.top_p <= 1, "rollout.top_p", "must be in (0, 1]", r.top_p)
    need(r.top_k >= 0, "rollout.top_k", "must be >= 0 (0 = off)", r.top_k)
    need(r.lenient is None or r.lenient >= 1.0, "rollout.lenient", "must be null (exact) or >= 1", r.lenient)
    need(r.lenient is None or (r.spec is not None and "history" in r.spec.proposers and r.history.enabled),
         "rollout.lenient", "needs the history proposer and rollout.history.enabled (it loosens history drafts)",
         r.lenient)
    need(r.chunk_tokens is None or r.chunk_tokens >= 1, "rollout.chunk_tokens", "must be >= 1 or null",
         r.chunk_tokens)
    need(r.history.keep_epochs >= 1, "rollout.history.keep_epochs", "must be >= 1", r.history.keep_epochs)
    need(r.num_cpus_per_worker >= 0, "rollout.num_cpus_per_worker", "must be >= 0", r.num_cpus_per_worker)
    need(r.num_gpus_per_worker >= 0, "rollout.num_gpus_per_worker", "must be >= 0", r.num_gpus_per_worker)
    if r.spec is not None:
        s = r.spec
        unknown = [name for name in s.proposers if name not in AVAILABLE_PROPOSERS]
        need(not unknown, "rollout.spec.proposers", f"has {unknown}, not among the available proposers "
             f"{list(AVAILABLE_PROPOSERS)} (rollout.spec: null turns speculation off)", s.proposers)
        need(bool(s.proposers), "rollout.spec.proposers", "must not be empty (rollout.spec: null turns "
             "speculation off)", s.proposers)
        need(len(set(s.proposers)) == len(s.proposers), "rollout.spec.proposers", "lists a proposer twice",
             s.proposers)
        need(s.max_draft_tokens >= 1, "rollout.spec.max_draft_tokens", "must be >= 1", s.max_draft_tokens)
        need(s.max_batch_for_spec is None or s.max_batch_for_spec >= 0, "rollout.spec.max_batch_for_spec",
             "must be >= 0 or null", s.max_batch_for_spec)
        need(bool(s.ngram_sizes) and min(s.ngram_sizes) >= 1, "rollout.spec.ngram_sizes",
             "must be integers >= 1", s.ngram_sizes)
        need(s.min_draft_prob is None or 0.0 <= s.min_draft_prob < 1.0, "rollout.spec.min_draft_prob",
             "must be null (by device) or in [0, 1)", s.min_draft_prob)
    _wrap(lambda: engine_config(r).validate(), "rollout")

    need(tr.epochs >= 1, "trainer.epochs", "must be >= 1", tr.epochs)
    need(tr.prompts_per_epoch >= 1, "trainer.prompts_per_epoch", "must be >= 1", tr.prompts_per_epoch)
    need(tr.lr > 0, "trainer.lr", "must be > 0", tr.lr)
    need(tr.clip_eps > 0, "trainer.clip_eps", "must be > 0", tr.clip_eps)
    need(tr.clip_eps_high is None or tr.clip_eps_high > 0, "trainer.clip_eps_high", "must be > 0 or null",
         tr.clip_eps_high)
    need(tr.kl_coef >= 0, "trainer.kl_coef", "must be >= 0", tr.kl_coef)
    need(tr.adv_eps > 0, "trainer.adv_eps", "must be > 0", tr.adv_eps)
    need(tr.update_epochs >= 1, "trainer.update_epochs", "must be >= 1", tr.update_epochs)
    need(tr.minibatch_size >= 0, "trainer.minibatch_size", "must be >= 0 (0 = whole rollout)", tr.minibatch_size)
    need(tr.micro_batch_size >= 1, "trainer.micro_batch_size", "must be >= 1", tr.micro_batch_size)
    need(tr.max_grad_norm > 0, "trainer.max_grad_norm", "must be > 0", tr.max_grad_norm)
    need(tr.num_threads is None or tr.num_threads >= 1, "trainer.num_threads", "must be >= 1 or null (auto)",
         tr.num_threads)
    need(0 <= tr.ppo.gamma <= 1, "trainer.ppo.gamma", "must be in [0, 1]", tr.ppo.gamma)
    need(0 <= tr.ppo.lam <= 1, "trainer.ppo.lam", "must be in [0, 1]", tr.ppo.lam)
    need(tr.ppo.vf_coef >= 0, "trainer.ppo.vf_coef", "must be >= 0", tr.ppo.vf_coef)
    need(tr.ppo.value_clip_eps > 0, "trainer.ppo.value_clip_eps", "must be > 0", tr.ppo.value_clip_eps)
    need(bool(o.dir), "output.dir", "must be a folder", o.dir)


def _wrap(check, key: str) -> None:
    try:
        check()
    except ValueError as e:
        raise ValueError(f"config section {key!r}: {e}") from None


def engine_config(r: RolloutSection, spec: Any = "config"):
    """The engine's config for this rollout section (spec=None forces plain decoding)."""
    from rollout import EngineConfig, SpecConfig

    s = r.spec if spec == "config" else spec
    spec_cfg = None if s is None else SpecConfig(
        proposers=tuple(s.proposers), max_draft_tokens=s.max_draft_tokens,
        max_batch_for_spec=s.max_batch_for_spec, ngram_sizes=tuple(s.ngram_sizes),
        min_draft_prob=s.min_draft_prob, lenience=r.lenient)
    return EngineConfig(max_batch_size=r.max_batch_size, max_model_len=r.max_model_len,
                        max_num_batched_tokens=r.max_num_batched_tokens, dtype=r.dtype, device=r.device,
                        num_threads=r.num_threads, spec=spec_cfg)
