"""The policy's weights as TRL's GRPOTrainer holds them, under the Hugging Face names spectail's
engine loads: unwrapped from accelerate's wrappers, PEFT adapters merged in, as TRL pushes them to
vLLM (trl/generation/vllm_generation.py, `_iter_named_params`). Sharded models (FSDP, ZeRO-3)
are refused up front: every process would have to gather each parameter in step.

    config, weights = policy_weights(trainer)       # on the process that owns the engine
"""
from __future__ import annotations

import torch


def unwrap(trainer):
    """The trainer's model without accelerate's wrappers (DDP, compile)."""
    accelerator = getattr(trainer, "accelerator", None)
    model = trainer.model
    return accelerator.unwrap_model(model) if accelerator is not None else model


def is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def check_not_sharded(trainer) -> None:
    if getattr(trainer, "is_fsdp_enabled", False):
        raise ValueError("SpectailRollout cannot read an FSDP-sharded policy (each process holds a shard); "
                         "train without FSDP, or use TRL's vLLM server mode")
    plugin = getattr(getattr(getattr(trainer, "accelerator", None), "state", None), "deepspeed_plugin", None)
    if getattr(trainer, "is_deepspeed_enabled", False) and getattr(plugin, "zero_stage", 0) == 3:
        raise ValueError("SpectailRollout cannot read a DeepSpeed ZeRO-3-sharded policy; use ZeRO stage 0-2")


def check_mergeable(model) -> None:
    """A PEFT model whose adapters cannot be folded into the base weights is refused: the engine
    runs plain Llama-family weights."""
    if not is_peft(model):
        return
    config = model.peft_config.get(getattr(model, "active_adapter", "default"))
    if getattr(config, "is_prompt_learning", False) or not hasattr(model, "merge_adapter"):
        kind = getattr(config, "peft_type", type(config).__name__)
        raise ValueError(f"SpectailRollout needs a PEFT adapter it can merge into the base weights (LoRA and "
                         f"similar); this model's adapter ({kind}) cannot be merged")


def policy_weights(trainer) -> tuple[object, dict[str, torch.Tensor]]:
    """(Hugging Face config, {name: tensor}) of the current policy, PEFT adapters merged in.
    Plain weights are the live tensors (detached, not copied: the engine copies them in at
    once); merged PEFT weights are copies, taken before the adapter is unmerged again."""
    model = unwrap(trainer)
    if not is_peft(model):
        return model.config, {k: v.detach() for k, v in model.state_dict().items()}
    check_mergeable(model)
    try:
        model.merge_adapter()
    except Exception as e:  # e.g. a quantized base layer that the adapter cannot be added to
        raise ValueError(f"SpectailRollout could not merge the PEFT adapter into the base weights: "
                         f"{type(e).__name__}: {e}") from e
    try:
        weights = merged_state(model)
    finally:
        model.unmerge_adapter()
    return model.get_base_model().config, weights


def merged_state(model) -> dict[str, torch.Tensor]:
    prefix = getattr(model, "prefix", "lora_")
    out = {}
    for name, param in model.named_parameters():
        name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        if prefix in name or "original_module" in name:
            continue
        out[name.replace("modules_to_save.default.", "")] = param.detach().clone()
    return out
