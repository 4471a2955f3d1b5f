"""The whole run's configuration: nested dataclasses, loaded from YAML, with dotted overrides.

    cfg = load_config("examples/demo.yaml", ["trainer.steps=3", "rollout.engine.spec.max_draft_tokens=16"])

The dataclass defaults ARE the embedded demo (`spectail demo` runs `RunConfig()`; a test keeps
examples/demo.yaml equal). Loading (config_loader.py) checks keys and types, `validate()` ranges
and choices, each error naming its dotted key. The engine's EngineConfig is `rollout.engine`
(`spec=null`: no speculation), its DrafterSpec `rollout.drafter`, each checked by its own validate().

Words, as in TRL and verl: a *step* is one rollout plus the optimizer updates made from it; an
*epoch* is one pass over the data set (old names raise a ValueError saying the new one, `RENAMED`).
"""
from __future__ import annotations

import copy
import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import ClassVar, Literal, Optional, Sequence, Union

from rollout import EngineConfig, SpecConfig
from rollout.config import DrafterSpec, is_device, need
from rollout.vllm_backend.config import VllmConfig

from .config_loader import apply_override, from_dict, read_yaml

RG_SYSTEM_PROMPT = ("Answer the question. Put the final answer alone inside <answer> and </answer> tags.\n"
                    "Example:\nQuestion: What is 3 + 4?\nReply: 3 + 4 = 7. <answer>7</answer>")
STEP_WORDS = "a step is one rollout plus its updates; an epoch is one pass over the data set"

@dataclass(frozen=True)
class TaskConfig:
    """The problem generator: the left addend is uniform in [min_start, max_start]; the right one
    (one response line per unit) in [min_count, max_count] with P(count) ~ count ** -tail_alpha."""

    num_problems: int = 256
    seed: int = 0
    min_start: int = 0
    max_start: int = 99
    min_count: int = 1
    max_count: int = 64
    tail_alpha: float = 1.3

    def validate(self) -> None:
        need(self.num_problems >= 0, "TaskConfig.num_problems", "must be >= 0", self.num_problems)
        need(0 <= self.min_start <= self.max_start, "TaskConfig", "needs 0 <= min_start <= max_start",
             (self.min_start, self.max_start))
        need(1 <= self.min_count <= self.max_count, "TaskConfig", "needs 1 <= min_count <= max_count",
             (self.min_count, self.max_count))
        need(self.tail_alpha >= 0.0, "TaskConfig.tail_alpha", "must be >= 0", self.tail_alpha)  # NaN fails


@dataclass(frozen=True)
class PolicyConfig:
    """The tiny policy (embeddings tied) and its supervised warm start.

    arch: prefer llama: transformers 5 replaces any qwen2 checkpoint's tokenizer.
    attention_bias: llama attention biases let a head attend by relative position from the first
        step, which this task (each line computed from the one above) needs.
    sft_*: supervised steps, tokens per batch, problems cycled through, and the share of training
        lines with an arithmetic slip: it sets the policy's starting accuracy robustly.
    lr, weight_decay, warmup_steps: AdamW, linear warm-up then cosine decay to lr / 10.
    num_threads: torch threads while training (0: torch's own); the matrices are too small to split.
    """

    arch: str = "llama"
    attention_bias: bool = True
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 1024
    sft_steps: int = 1800
    sft_tokens_per_batch: int = 512
    sft_pool: int = 20000
    sft_slip_rate: float = 0.1
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup_steps: int = 50
    seed: int = 1234
    num_threads: int = 1

    def validate(self) -> None:
        shape = (self.hidden_size, self.num_heads, self.num_kv_heads)
        need(self.arch in ("llama", "qwen2"), "PolicyConfig.arch", "must be 'llama' or 'qwen2'", self.arch)
        need(min(shape) >= 1, "PolicyConfig", "needs hidden_size, num_heads and num_kv_heads >= 1", shape)
        need(self.hidden_size % self.num_heads == 0 and self.num_heads % self.num_kv_heads == 0, "PolicyConfig",
             "needs hidden_size % num_heads == 0 and num_heads % num_kv_heads == 0", shape)
        need(self.sft_steps >= 0, "PolicyConfig.sft_steps", "must be >= 0", self.sft_steps)


@dataclass
class ParquetSource:
    """A data set on disk, one row per prompt (rl_integration/dataset.py); `answer_key` may be dotted
    for a struct column's field (verl's "reward_model.ground_truth")."""

    path: str = ""
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    data_source_key: str = "data_source"
    extra_info_key: str = "extra_info"


@dataclass
class ReasoningGymSource:
    """A reasoning-gym data set (rl_integration/reasoning_gym_task.py): `size` problems of `name`
    made with `seed` and `config` (its keyword arguments; a given mapping replaces the default).
    The reward is the data set's score_answer, plus format_reward for exactly one non-empty
    <answer> pair. answer_extraction: "strict", the last <answer>...</answer>, or "flexible",
    that or else the response's last number (as verl's gsm8k scorer)."""

    name: str = "basic_arithmetic"
    size: int = 48
    seed: int = 0
    # easy enough that the untrained SmolLM2-135M-Instruct is sometimes right (docs/configuration.md)
    config: dict = field(default_factory=lambda: {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                                                  "operators": ["+"], "allow_parentheses": False,
                                                  "allow_negation": False})
    system_prompt: str = RG_SYSTEM_PROMPT
    format_reward: float = 0.1
    answer_extraction: Literal["strict", "flexible"] = "flexible"


@dataclass
class CustomRewardFunction:
    """verl's reward.custom_reward_function: `name` in `path` (a file or "pkg://module"), rewards.py."""

    path: Optional[str] = None
    name: str = "compute_score"


@dataclass
class TaskSection:
    """reward: "embedded" (the source's own), "package.module:function" called as fn(response_text,
    answer), or custom_reward_function's scorer when its path is set."""

    source: Literal["embedded", "parquet", "reasoning_gym"] = "embedded"
    embedded: TaskConfig = field(default_factory=lambda: TaskConfig(num_problems=64, seed=0))
    parquet: ParquetSource = field(default_factory=ParquetSource)
    reasoning_gym: ReasoningGymSource = field(default_factory=ReasoningGymSource)
    reward: str = "embedded"
    custom_reward_function: CustomRewardFunction = field(default_factory=CustomRewardFunction)


@dataclass
class PolicySection:
    """source: "embedded" (the tiny policy, its SFT cached under cache_dir) or "checkpoint" (a
    Hugging Face folder or hub id). chat_template: a Jinja template in place of the tokenizer's."""

    source: Literal["embedded", "checkpoint"] = "embedded"
    embedded: PolicyConfig = field(default_factory=PolicyConfig)
    checkpoint: str = ""
    cache_dir: Optional[str] = None  # None: $SPECTAIL_CACHE, else ~/.cache/spectail
    chat_template: Optional[str] = None


@dataclass
class HistorySection:
    """History reuse (scheduler/history_store.py), when enabled and "history" is among the proposers.
    max_bytes: the store's bound; max_age_steps: the oldest response that drafts (None: any)."""

    enabled: bool = True
    dir: Optional[str] = None  # None: <output.dir>/history
    max_bytes: int = 8 * 2**30
    max_age_steps: Optional[int] = None

    RENAMED: ClassVar[dict] = {"keep_epochs": "max_age_steps"}
    RENAMED_WHY: ClassVar[str] = ("the store keeps the newest response of each (prompt, sample) whatever step "
                                  "wrote it, bounded by max_bytes; max_age_steps, null by default, limits its age")


def demo_engine() -> EngineConfig:
    """The demo's engine: no "ngram", whose drafts add nothing here once history exists."""
    return EngineConfig(max_batch_size=64, max_model_len=1024, max_num_batched_tokens=2048,
                        spec=SpecConfig(proposers=("history", "suffix", "lookahead"), max_draft_tokens=24))


@dataclass
class RolloutSection:
    """How rollouts run; `engine` and `drafter` are checked where they are defined (rollout/config.py)."""

    name: Literal["spectail", "vllm"] = "spectail"  # the engine (verl: actor_rollout_ref.rollout.name)
    backend: Literal["local", "ray"] = "local"
    num_workers: int = 1  # ray only
    engine: EngineConfig = field(default_factory=demo_engine)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 512
    n: int = 8  # samples per prompt (a GRPO group)
    noise: Literal["per_sample", "per_step"] = "per_step"  # per_sample: faster, biased (README)
    seed: Optional[int] = None  # the sampling noise's seed (None: trainer.seed)
    history: HistorySection = field(default_factory=HistorySection)
    drafter: DrafterSpec = field(default_factory=DrafterSpec)  # the online drafter (rollout/config.py)
    chunk_tokens: Optional[int] = None  # ray only: divided rollout chunk size (null: its default)
    # ray only: KV slots a worker keeps for requests it paused (null: ray_backend.default_kept_slots)
    kept_slots: Optional[int] = None
    num_cpus_per_worker: float = 1.0
    num_gpus_per_worker: float = 0.0
    ray_address: Optional[str] = None  # None: $RAY_ADDRESS or a local Ray
    vllm: VllmConfig = field(default_factory=VllmConfig)  # name: vllm only (rollout/vllm_backend/config.py)

    RENAMED_VALUES: ClassVar[dict] = {"noise": {"per_epoch": "per_step"}}
    RENAMED_WHY: ClassVar[str] = STEP_WORDS


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
    steps: int = 5  # rollouts, each followed by its optimizer updates
    prompts_per_step: int = 64  # step s rolls out the s-th window of the data set (seeded order, wrapping)
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
    # checkpoints (rl_integration/resume.py, docs/checkpoints.md): output.dir/checkpoints/step-N
    save_every: int = 0  # save after every this many steps, and after the last (0: never)
    keep_checkpoints: Optional[int] = 2  # the newest this many are kept (null: all)
    resume: Optional[str] = None  # "auto": the newest complete checkpoint in output.dir, if any; or a folder

    RENAMED: ClassVar[dict] = {"epochs": "steps", "prompts_per_epoch": "prompts_per_step"}
    RENAMED_WHY: ClassVar[str] = STEP_WORDS


@dataclass
class OutputSection:
    dir: str = "runs/demo"
    compare: bool = False  # also run the plain engine each step: speedup and identity check
    plot: bool = True
    progress: bool = True  # tqdm bars


@dataclass
class RunConfig:
    task: TaskSection = field(default_factory=TaskSection)
    policy: PolicySection = field(default_factory=PolicySection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    output: OutputSection = field(default_factory=OutputSection)


# What a resumed run may set differently from its checkpoint's run.yaml (a key covers its subkeys):
# keys that change neither samples nor updates, only speed, placement, output or length, and
# locations whose content is checked instead. Drafts, batching and rollout threads change logprobs
# by float rounding only; the trainer's arithmetic (device, threads, micro-batches) is refused.
RESUME_MAY_CHANGE = (
    "trainer.steps", "trainer.save_every", "trainer.keep_checkpoints", "trainer.resume", "output",
    "policy.cache_dir", "policy.checkpoint", "task.parquet.path",
    "rollout.backend", "rollout.num_workers", "rollout.chunk_tokens", "rollout.kept_slots",
    "rollout.num_cpus_per_worker", "rollout.num_gpus_per_worker", "rollout.ray_address",
    "rollout.engine.max_batch_size", "rollout.engine.max_num_batched_tokens", "rollout.engine.num_threads",
    "rollout.engine.share_prompts", "rollout.engine.spec", "rollout.history", "rollout.drafter",
)
# ... except these, which change the samples (lenience accepts history tokens the policy did not sample)
RESUME_MUST_KEEP = ("rollout.engine.spec.lenience",)


def upgrade_saved(raw: dict) -> dict:
    """A checkpoint's run.yaml with drafter keys of older sections moved to rollout.drafter."""
    raw = copy.deepcopy(raw)
    rollout = raw.get("rollout") if isinstance(raw.get("rollout"), dict) else {}
    spec = (rollout.get("engine") or {}).get("spec") if isinstance(rollout.get("engine"), dict) else None
    drafter = rollout.get("drafter")
    for old in (drafter.pop("train", None) if isinstance(drafter, dict) else None,
                spec.pop("drafter", None) if isinstance(spec, dict) else None):
        for key, value in (old if isinstance(old, dict) and isinstance(drafter, dict) else {}).items():
            if key in {f.name for f in dataclasses.fields(DrafterSpec)}:  # (max_positions is gone)
                drafter.setdefault(key, value)
    return raw


def load_config(path: Optional[Union[str, os.PathLike]] = None, overrides: Sequence[str] = ()) -> RunConfig:
    """RunConfig from a YAML file (None: the demo defaults) plus `key.sub=value` overrides."""
    raw = read_yaml(path)
    for item in overrides:
        apply_override(raw, item)
    cfg = from_dict(RunConfig, raw)
    validate(cfg)
    return cfg


def validate(cfg: RunConfig) -> None:
    """Ranges and cross-field rules, each error naming its dotted key. Types are already checked."""
    _validate_sources(cfg)
    _validate_rollout(cfg.rollout)
    _validate_trainer(cfg.trainer)
    _need(bool(cfg.output.dir), "output.dir", "must be a folder", cfg.output.dir)
    seeds = {"trainer.seed": cfg.trainer.seed, "rollout.seed": cfg.rollout.seed,
             "task.embedded.seed": cfg.task.embedded.seed, "policy.embedded.seed": cfg.policy.embedded.seed,
             "task.reasoning_gym.seed": cfg.task.reasoning_gym.seed}
    for key, seed in seeds.items():
        _need(seed is None or 0 <= seed < 2**63, key, "must be in [0, 2**63)", seed)


def _need(ok: bool, key: str, msg: str, value) -> None:
    need(ok, f"config key {key!r}", msg, value)


# where the classes whose validate() the run config calls sit in it
_SECTIONS = {"TaskConfig": "task.embedded", "PolicyConfig": "policy.embedded", "EngineConfig": "rollout.engine",
             "SpecConfig": "rollout.engine.spec", "DrafterSpec": "rollout.drafter",
             "VllmConfig": "rollout.vllm"}


def _wrap(check, key: str) -> None:
    """Run a section's own validate(), its message's Class.field names turned into dotted keys."""
    try:
        check()
    except ValueError as e:
        text = re.sub(r"\b(" + "|".join(_SECTIONS) + r")\.(\w+)", lambda m: f"'{_SECTIONS[m[1]]}.{m[2]}'", str(e))
        raise ValueError(f"config section {key!r}: {text}") from None


def _validate_sources(cfg: RunConfig) -> None:
    t, p = cfg.task, cfg.policy
    if t.source == "parquet":
        _need(bool(t.parquet.path), "task.parquet.path", "must name a Parquet file when task.source is 'parquet'",
              t.parquet.path)
    elif t.source == "reasoning_gym":
        from .reasoning_gym_task import validate_source

        validate_source(t.reasoning_gym)
    else:
        _wrap(t.embedded.validate, "task.embedded")
    _need(t.reward == "embedded" or ":" in t.reward, "task.reward",
          "must be 'embedded' or 'package.module:function'", t.reward)
    custom = t.custom_reward_function
    _need(custom.path is None or bool(custom.path.strip()), "task.custom_reward_function.path",
          "must name a Python file or pkg://module, or be null", custom.path)
    _need(not custom.path or t.reward == "embedded", "task.reward", "must stay 'embedded' when "
          "task.custom_reward_function.path is set (that scorer replaces it): set one of the two", t.reward)
    _need(bool(custom.name), "task.custom_reward_function.name", "must name the function", custom.name)
    if p.source == "checkpoint":
        _need(bool(p.checkpoint), "policy.checkpoint", "must name a local model folder or a Hugging Face hub id "
              "when policy.source is 'checkpoint'", p.checkpoint)
    else:
        _wrap(p.embedded.validate, "policy.embedded")


def _validate_rollout(r: RolloutSection) -> None:
    _bounds(r, "rollout", "n>=1 num_workers>=1 max_tokens>=1 top_k>=0 chunk_tokens>=1? kept_slots>=0? "
                          "num_cpus_per_worker>=0 num_gpus_per_worker>=0")
    _bounds(r.history, "rollout.history", "max_bytes>=0 max_age_steps>=1?")
    _need(r.temperature > 0, "rollout.temperature", "must be > 0 for RL (T = 0 has no exploration and its "
          "logprobs are not the sampling distribution's)", r.temperature)
    _need(0 < r.top_p <= 1, "rollout.top_p", "must be in (0, 1]", r.top_p)
    _wrap(r.engine.validate, "rollout.engine")
    _wrap(r.drafter.validate, "rollout.drafter")
    _wrap(r.vllm.validate, "rollout.vllm")
    if r.name == "vllm" and r.engine.spec is not None:
        raise ValueError("config key 'rollout.engine.spec' must be null when rollout.name is 'vllm': spectail's "
                         "proposers do not run inside vLLM, whose own speculation is rollout.vllm.speculation "
                         "(ngram | suffix); add rollout.engine.spec=null")
    spec = r.engine.spec
    _need(spec is None or "drafter" not in spec.proposers or r.drafter.enabled, "rollout.engine.spec.proposers",
          "lists drafter: set rollout.drafter.enabled=true instead (it adds the drafter with its settings)",
          None if spec is None else spec.proposers)
    lenience = None if spec is None else spec.lenience
    _need(lenience is None or ("history" in spec.proposers and r.history.enabled), "rollout.engine.spec.lenience",
          "needs the history proposer and rollout.history.enabled (it loosens history drafts)", lenience)


def _validate_trainer(tr: TrainerSection) -> None:
    _bounds(tr, "trainer", "steps>=1 prompts_per_step>=1 lr>0 clip_eps>0 clip_eps_high>0? kl_coef>=0 adv_eps>0 "
                           "update_epochs>=1 minibatch_size>=0 micro_batch_size>=1 max_grad_norm>0 num_threads>=1? "
                           "save_every>=0 keep_checkpoints>=1?")
    _bounds(tr.ppo, "trainer.ppo", "vf_coef>=0 value_clip_eps>0")
    for name in ("gamma", "lam"):
        _need(0 <= getattr(tr.ppo, name) <= 1, f"trainer.ppo.{name}", "must be in [0, 1]", getattr(tr.ppo, name))
    _need(is_device(tr.device), "trainer.device", "must name a torch device ('cpu', 'cuda', 'cuda:1', ...)",
          tr.device)
    _need(tr.resume is None or bool(tr.resume.strip()), "trainer.resume",
          "must be null, 'auto' or a checkpoint folder", tr.resume)


_BOUND = re.compile(r"(\w+)(>=|>)([\d.]+)(\??)")


def _bounds(section, key: str, rules: str) -> None:
    """Range checks of a section's fields: each rule `name>=low` or `name>low`, `?` where null passes."""
    for name, op, low, null in _BOUND.findall(rules):
        v, low = getattr(section, name), float(low)
        ok = (null and v is None) or (v is not None and (v >= low if op == ">=" else v > low))  # NaN fails
        _need(ok, f"{key}.{name}", f"must be {op} {low:g}" + (" or null" if null else ""), v)


def plain_engine(r: RolloutSection) -> EngineConfig:
    """The rollout section's engine without speculation (the reference run of --compare)."""
    return dataclasses.replace(r.engine, spec=None)
