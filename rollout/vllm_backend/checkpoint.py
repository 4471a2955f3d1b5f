"""The checkpoint folder a vLLM engine starts from (vLLM loads only from disk: an in-memory model
is written to a temporary folder, `materialise`), and the checks made on it before vLLM starts,
each a ValueError: vLLM implements the architecture, and on the CPU the head size (else vLLM
fails late, inside its engine process)."""
from __future__ import annotations

import copy
import os
import tempfile
from pathlib import Path
from typing import Optional, Sequence

import torch

from ..core.model import read_config


def check_architecture(folder: Path, supported: Sequence[str]) -> None:
    """ValueError unless the checkpoint's config names an architecture vLLM implements."""
    archs = read_config(folder).get("architectures") or []
    if not any(a in supported for a in archs):
        raise ValueError(f"unsupported architecture {archs or 'unnamed (config.json has no architectures)'}: "
                         f"vLLM implements none of them")


def check_head_size(folder: Path, supported: Optional[Sequence[int]]) -> None:
    """ValueError when the model's attention head size is not in `supported` (None: any)."""
    c = read_config(folder)
    size = int(c.get("head_dim") or int(c.get("hidden_size", 0)) // int(c.get("num_attention_heads") or 1))
    if supported is not None and size not in supported:
        raise ValueError(f"the model's attention head size is {size} (hidden_size / num_attention_heads), which "
                         f"vLLM's CPU attention does not implement (it does {sorted(supported)}): choose "
                         f"num_attention_heads so that the head size is one of them, or use rollout.name=spectail")


def cpu_head_sizes() -> Optional[list[int]]:
    """The head sizes vLLM's CPU attention implements (None where that backend is absent)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:
        return None
    return list(CPUAttentionBackend.get_supported_head_sizes())


def materialise(source) -> tuple[Path, Optional[str]]:
    """(folder, temporary folder to remove or None) for a checkpoint folder, a transformers
    causal LM or a (Hugging Face config, state dict) pair."""
    if isinstance(source, (str, os.PathLike)):
        return Path(source), None
    tmp = tempfile.mkdtemp(prefix="spectail-vllm-ckpt-")
    try:
        if isinstance(source, torch.nn.Module) and hasattr(source, "save_pretrained"):
            source.save_pretrained(tmp)
        elif isinstance(source, tuple) and len(source) == 2 and isinstance(source[1], dict):
            save_pair(source[0], source[1], Path(tmp))
        else:
            raise ValueError("the vLLM engine's model must be a checkpoint folder, a transformers model or a "
                             f"(Hugging Face config, state dict) pair, got {type(source).__name__}")
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Path(tmp), tmp


def save_pair(config, state: dict, folder: Path) -> None:
    """config.json (with its architecture named) and model.safetensors, as save_pretrained would."""
    from safetensors.torch import save_file
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = copy.deepcopy(config)  # the caller's config is left as it was
    if not config.architectures:  # a model built from a config, never saved: name its class
        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
        if arch is None:
            raise ValueError(f"model_type {config.model_type!r} has no transformers causal-LM class to name")
        config.architectures = [arch]
    config.save_pretrained(folder)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in state.items()
               if isinstance(t, torch.Tensor) and not (tied and name == "lm_head.weight")
               and not name.endswith("rotary_emb.inv_freq")}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
