"""SpectailRollout: spectail's exact speculative rollouts inside TRL's GRPOTrainer, through its
`rollout_func` hook (docs/trl.md):

    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...,
                          rollout_func=SpectailRollout())

`config` holds the rollout settings in the run config's `rollout:` layout; the sampling keys are
GRPOConfig's and refused there. `rollout_section` is the one function that knows that layout.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from .config import RolloutSection, RunConfig, validate
from .config_loader import from_dict, to_dict
from .rollout_client import RolloutClient, build_backend
from .trl_gather import gather_generate_scatter
from .trl_weights import check_mergeable, check_not_sharded, policy_weights, unwrap

GRPO_OWNED = ("temperature", "top_p", "top_k", "max_tokens", "n")
DEFAULT_MAX_MODEL_LEN = 4096  # the static KV cache is slots x this long: set it to what the task needs


class SpectailRollout:
    """A TRL `rollout_func`. config: None, a mapping of rollout settings (the run config's
    `rollout:` section) or a RolloutSection. seed: the sampling noise's run seed (default
    GRPOConfig.seed). history_dir: where history records live (default <output_dir>/spectail-history).
    echo: prints one line of rollout metrics per generation (None: silent)."""

    def __init__(self, config: Union[None, Mapping[str, Any], RolloutSection] = None, *,
                 seed: Optional[int] = None, history_dir: Optional[str] = None,
                 echo: Optional[Callable[[str], None]] = print):
        raw = to_dict(config) if isinstance(config, RolloutSection) else dict(config or {})
        owned = [k for k in GRPO_OWNED if k in raw]
        if owned:
            raise ValueError(f"SpectailRollout config sets {owned}: GRPOConfig owns them (temperature, top_p, "
                             "top_k, max_completion_length, num_generations); set them there")
        from_dict(RolloutSection, raw, "rollout")  # unknown keys and wrong types fail here, by name
        self.options, self.seed, self.history_dir, self.echo = raw, seed, history_dir, echo
        self.section: Optional[RolloutSection] = None
        self.client: Optional[RolloutClient] = None
        self.steps = 0  # rollouts made: the noise's step
        self.synced_step: Optional[int] = None  # trainer.state.global_step the engine's weights are from
        self.records: list[dict] = []  # per rollout: the metrics printed

    def __call__(self, prompts: Sequence, trainer) -> dict:
        if self.section is None:  # everything that can be refused is, before the first rollout
            check_trainer(trainer)
            self.section = rollout_section(self.options, trainer, self.history_dir)
        mode = "train" if trainer.model.training else "eval"
        group = trainer.num_generations if mode == "train" else trainer.num_generations_eval
        ids = tokenize(trainer, prompts)
        check_lengths(ids, prompts, self.section.engine.max_model_len)
        rows, shared = gather_generate_scatter(ids, lambda every: self._generate(every, group, trainer),
                                               getattr(trainer, "accelerator", None))
        self._report(shared["metrics"], trainer, mode)
        return rows

    # ---- on the main process --------------------------------------------------------------

    def _generate(self, ids: list[list[int]], group: int, trainer) -> tuple[dict, dict]:
        prompts = group_prompts(ids, group)
        self._sync(trainer)
        batch = self.client.generate(prompts, n=group, step=self.steps)
        self.steps += 1
        rows = {
            "prompt_ids": batch.prompt_ids, "completion_ids": batch.completion_ids, "logprobs": batch.logprobs,
            "spectail_seed": batch.seeds, "finish_reason": batch.finish_reasons,
            "spectail_accepted_tokens": [sum(s.get("accepted", {}).values()) for s in batch.sample_stats],
            "spectail_forward_passes": [int(s.get("forward_passes", 0)) for s in batch.sample_stats],
        }
        return rows, {"metrics": step_summary(batch.step_stats, self.steps - 1)}

    def _sync(self, trainer) -> None:
        """Build the engine from the policy on first use; push the weights when an optimizer
        step has happened since the last push."""
        step = trainer.state.global_step
        if self.client is None:
            config, weights = policy_weights(trainer)
            self.client = make_client(self.section, trainer, config, weights, self.seed)
        elif step != self.synced_step:
            self.client.update_weights(policy_weights(trainer)[1])
        self.synced_step = step

    def _report(self, record: dict, trainer, mode: str) -> None:
        self.records.append(record)
        accelerator = getattr(trainer, "accelerator", None)
        if self.echo is not None and (accelerator is None or accelerator.is_main_process):
            self.echo(format_summary(record))
        store = getattr(trainer, "_metrics", None)  # TRL logs these lists' means with its own metrics
        if isinstance(store, dict) and mode in store:
            for key in ("tokens_per_second", "tokens_per_forward", "generated_tokens", "accepted_tokens"):
                store[mode][f"spectail/{key}"].append(float(record[key]))

    def shutdown(self) -> None:
        if self.client is not None:
            self.client.shutdown()
            self.client = None


# ---- the pieces --------------------------------------------------------------------------------


def rollout_section(options: Mapping[str, Any], trainer, history_dir: Optional[str] = None) -> RolloutSection:
    """The RolloutClient's config: the user's rollout settings plus what GRPOConfig decides
    (sampling, lengths, group size) and defaults taken from the trainer (device, batch size,
    history folder). The one place that knows the run config's layout."""
    args = trainer.args
    raw = dict(options)
    top_k = args.top_k if args.top_k not in (None, -1) else 0
    raw.update(temperature=float(args.temperature), top_p=float(args.top_p), top_k=int(top_k),
               max_tokens=int(args.max_completion_length), n=int(trainer.num_generations))
    engine = dict(raw.get("engine") or {})
    engine.setdefault("device", str(trainer.accelerator.device))
    engine.setdefault("max_batch_size", max(1, min(256, int(args.generation_batch_size))))
    max_pos = getattr(unwrap(trainer).config, "max_position_embeddings", None) or DEFAULT_MAX_MODEL_LEN
    engine.setdefault("max_model_len", min(int(max_pos), DEFAULT_MAX_MODEL_LEN))
    raw["engine"] = engine
    history = dict(raw.get("history") or {})
    history.setdefault("dir", history_dir or f"{args.output_dir}/spectail-history")
    raw["history"] = history
    section = from_dict(RolloutSection, raw, "rollout")
    validate(RunConfig(rollout=section))
    return section


def check_trainer(trainer) -> None:
    """The trainer settings this adapter cannot honour, refused by name before any rollout."""
    args = trainer.args
    if getattr(trainer, "use_vllm", False) or getattr(args, "use_vllm", False):
        raise ValueError("GRPOConfig(use_vllm=True) and rollout_func=SpectailRollout(...) would both generate: "
                         "set use_vllm=False (spectail's engine does the rollouts)")
    if getattr(trainer, "tools", None) or getattr(trainer, "environment_factories", None):
        raise ValueError("SpectailRollout does not drive TRL's tool-calling loop: pass no tools / environment_factory")
    if getattr(args, "min_p", None) not in (None, 0, 0.0):
        raise ValueError(f"GRPOConfig.min_p={args.min_p} is not supported by SpectailRollout (use top_p / top_k)")
    if getattr(args, "repetition_penalty", 1.0) != 1.0:
        raise ValueError(f"GRPOConfig.repetition_penalty={args.repetition_penalty} is not supported by "
                         "SpectailRollout: it is not a sample of the policy")
    if getattr(args, "generation_kwargs", None):
        raise ValueError(f"GRPOConfig.generation_kwargs={args.generation_kwargs!r} is not supported by SpectailRollout")
    if not args.temperature > 0:
        raise ValueError(f"GRPOConfig.temperature must be > 0 for RL with SpectailRollout, got {args.temperature}")
    check_not_sharded(trainer)
    check_mergeable(unwrap(trainer))
    top_k = args.top_k if args.top_k not in (None, -1) else 0
    if args.top_p < 1.0 or top_k > 0:
        warnings.warn(f"top_p={args.top_p}, top_k={top_k}: TRL computes its training logprobs with temperature "
                      "only, so they are not the logprobs of the truncated distribution the rollouts are sampled "
                      "from (spectail's logprobs are); keep top_p=1.0 and top_k=0 for on-policy GRPO", stacklevel=3)


def tokenize(trainer, prompts: Sequence) -> list[list[int]]:
    """Prompt ids exactly as TRL makes them (trl 1.16 GRPOTrainer._tokenize_prompts; the same
    calls here when a later TRL renames it). Text only."""
    own = getattr(trainer, "_tokenize_prompts", None)
    if own is not None:
        ids, images, extra = own(list(prompts))
        if images is not None or extra:
            raise ValueError("SpectailRollout supports text prompts only; this batch carries images or other "
                             "multimodal inputs")
    elif prompts and isinstance(prompts[0], list):  # chat messages
        ids = trainer.processing_class.apply_chat_template(
            conversation=list(prompts), add_generation_prompt=True, tokenize=True, return_dict=True,
            **(getattr(trainer, "chat_template_kwargs", None) or {}))["input_ids"]
    else:
        ids = trainer.processing_class(text=list(prompts))["input_ids"]
    return [[int(t) for t in p] for p in ids]


def check_lengths(ids: list[list[int]], prompts: Sequence, max_model_len: int) -> None:
    for i, p in enumerate(ids):
        if len(p) >= max_model_len:
            raise ValueError(f"prompt {i} ({str(prompts[i])[:60]!r}) has {len(p)} tokens, but the rollout engine's "
                             f"max_model_len is {max_model_len} (SpectailRollout config 'engine.max_model_len'), "
                             "leaving no room for a completion")


def group_prompts(ids: list[list[int]], group: int) -> list[list[int]]:
    """One prompt per GRPO group: TRL passes each prompt `group` times in a row."""
    if len(ids) % group:
        raise ValueError(f"rollout_func got {len(ids)} prompts, not a multiple of num_generations={group}")
    firsts = ids[::group]
    for k, first in enumerate(firsts):
        if any(p != first for p in ids[k * group:(k + 1) * group]):
            raise ValueError(f"prompts {k * group}..{(k + 1) * group - 1} are not {group} copies of one prompt; "
                             "TRL's RepeatSampler passes each prompt num_generations times in a row")
    return firsts


def make_client(section: RolloutSection, trainer, config, weights: dict, seed: Optional[int]) -> RolloutClient:
    eos = getattr(trainer, "eos_token_ids", None)
    if eos is None:
        eos = [trainer.processing_class.eos_token_id]
    backend = build_backend(section, (config, weights), section.engine)
    run_seed = trainer.args.seed if seed is None else seed
    return RolloutClient(section, None, seed=run_seed, stop_token_ids=[int(t) for t in eos],
                         history_dir=section.history.dir, backend=backend)


def step_summary(stats: dict, step: int) -> dict:
    return {"step": step, "generated_tokens": int(stats["generated_tokens"]),
            "rollout_seconds": float(stats["rollout_seconds"]),
            "tokens_per_second": float(stats["tokens_per_second"]),
            "tokens_per_forward": float(stats["accepted_per_verify"]),
            "accepted": dict(stats.get("accepted", {})), "proposed": dict(stats.get("proposed", {})),
            "accepted_tokens": int(sum(stats.get("accepted", {}).values())),
            "reused_tokens": int(stats.get("reused_tokens", 0))}


def format_summary(r: dict) -> str:
    accepted = ", ".join(f"{k} {v}/{r['proposed'].get(k, 0)}" for k, v in sorted(r["accepted"].items())) or "none"
    return (f"spectail rollout {r['step']}: {r['generated_tokens']} tokens in {r['rollout_seconds']:.2f}s "
            f"({r['tokens_per_second']:.1f} tokens/s), {r['tokens_per_forward']:.2f} tokens per forward, "
            f"accepted/proposed draft tokens: {accepted}")


