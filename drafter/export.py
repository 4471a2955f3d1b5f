"""Saving and loading a draft head: safetensors + config.json in vLLM's EAGLE-1 layout for a Llama
draft (llama_eagle.py: `fc`, the HASS norms of `add_para_norm`, layer 0 without input_layernorm;
no embed_tokens or lm_head: vLLM shares the target's). `draft_vocab` is saved with the weights;
our own "spectail_drafter" section lets `load` refuse a head made for another policy shape.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import torch

from rollout.core.model import CausalLM

from .head import DraftHead, HeadConfig
from .vocab import check_ids

FORMAT = 1
WEIGHTS = "model.safetensors"
CONFIG = "config.json"


def eagle_config(head: DraftHead) -> dict:
    """The Hugging Face Llama config of the head's EAGLE layout."""
    c = head.cfg
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": head.hidden_size, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps, "vocab_size": head.vocab_size,
        "rope_theta": c.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "max_position_embeddings": 1 << 20, "attention_bias": bool(c.attention_bias), "mlp_bias": False,
        "tie_word_embeddings": False, "add_para_norm": True,
        **({"sliding_window": c.window} if c.window is not None else {}),
        "torch_dtype": str(head.fc.weight.dtype).removeprefix("torch."),
    }


def _check_finite(tensors: dict, what: str) -> None:
    for name, t in tensors.items():
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{what}: weight {name!r} contains NaN or Inf")


def export(head: DraftHead, folder: str | os.PathLike, version: Optional[int] = None) -> Path:
    """Write the head to `folder` (replaced as a whole: written beside it, then renamed in).
    version: the online trainer's version of it, kept in the config (`read_state`)."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    _check_finite(tensors, "export")
    config = eagle_config(head) if head.kind == "attention" else {}
    config["spectail_drafter"] = {"format": FORMAT, "kind": head.kind, "hidden_size": head.hidden_size,
                                  "vocab_size": head.vocab_size, "head": dataclasses.asdict(head.cfg),
                                  **({"version": int(version)} if version is not None else {})}
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".tmp-{folder.name}-"))
    try:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(config, indent=2))
        os.chmod(tmp, 0o755)
        if folder.exists():
            shutil.rmtree(folder)
        os.rename(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def export_state(state: dict, folder: str | os.PathLike, version: Optional[int] = None) -> Path:
    """`export` of a head given as `head_state` (what a Ray worker published), checked first."""
    cfg, hidden, vocab = _head_config(state, None, "draft head state")
    return export(head_from_tensors(cfg, hidden, vocab, state["weights"], None, None, "cpu", "draft head state"),
                  folder, version)


def load(folder: str | os.PathLike, policy: CausalLM, dtype: Optional[torch.dtype] = None, device=None) -> DraftHead:
    """The head saved in `folder`, for this policy (dtype and device default to the policy's);
    ValueError naming what does not fit (not an export, other sizes, weights missing or NaN)."""
    return from_state(read_state(folder)[0], policy, dtype, device, where=str(folder))


def read_state(folder: str | os.PathLike) -> tuple[dict, int]:
    """(head_state, version) of an exported folder (version 0: none recorded), unchecked against a
    policy (`check_state`, `from_state` do that); ValueError for a folder that is not an export."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / CONFIG).is_file() or not (folder / WEIGHTS).is_file():
        raise ValueError(f"{folder} is not a drafter export (needs {CONFIG} and {WEIGHTS})")
    try:
        config = json.loads((folder / CONFIG).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{folder}/{CONFIG} is not valid JSON: {e}") from None
    meta = config.get("spectail_drafter") if isinstance(config, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or "head" not in meta:
        raise ValueError(f"{folder}/{CONFIG} has no spectail_drafter section of format {FORMAT}")
    version = meta.get("version", 0)
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"{folder}/{CONFIG}: spectail_drafter.version must be an integer >= 0, got {version!r}")
    try:
        weights = load_file(str(folder / WEIGHTS))
    except Exception as e:  # safetensors raises its own error types for a damaged file
        raise ValueError(f"{folder}/{WEIGHTS} does not load ({type(e).__name__}: {e})") from None
    return {"format": FORMAT, "head": meta["head"], "hidden_size": meta.get("hidden_size"),
            "vocab_size": meta.get("vocab_size"), "weights": weights}, version


def _head_config(state, sizes: Optional[tuple[int, int]], where: str) -> tuple[HeadConfig, int, int]:
    """(head config, hidden size, vocabulary) of a head state, checked against the policy's sizes."""
    if not isinstance(state, dict) or state.get("format") != FORMAT or not isinstance(state.get("weights"), dict):
        raise ValueError(f"not a drafter head state of format {FORMAT}")
    meta = state
    try:
        hidden, vocab = int(meta["hidden_size"]), int(meta["vocab_size"])
        cfg = HeadConfig(**meta["head"])
        cfg.validate()
    except (TypeError, KeyError, ValueError) as e:
        raise ValueError(f"{where}: bad draft head config: {e}") from None
    if sizes is not None and (hidden, vocab) != tuple(sizes):
        raise ValueError(f"{where}: draft head made for hidden size {hidden} and vocabulary {vocab}, "
                         f"the policy has {sizes[0]} and {sizes[1]}")
    return cfg, hidden, vocab


def head_state(head: DraftHead) -> dict:
    """A head as plain data (what a Ray worker publishes): its config, sizes and CPU weights."""
    return {"format": FORMAT, "head": dataclasses.asdict(head.cfg), "hidden_size": head.hidden_size,
            "vocab_size": head.vocab_size,
            "weights": {k: v.detach().to("cpu", copy=True) for k, v in head.state_dict().items()}}


def check_state(state: dict, hidden_size: int, vocab_size: int) -> None:
    """ValueError unless `state` is a head for a policy of these sizes, with the weights its config
    names, of their shapes, all finite (nothing is built)."""
    cfg, hidden, vocab = _head_config(state, (hidden_size, vocab_size), "draft head state")
    _check_tensors(cfg, hidden, vocab, state["weights"], "draft head state")


def from_state(state: dict, policy: CausalLM, dtype: Optional[torch.dtype] = None, device=None,
               where: str = "draft head state") -> DraftHead:
    """The head `head_state` described, checked as `load` checks a folder (ValueError)."""
    sizes = (policy.cfg.hidden_size, policy.cfg.vocab_size)
    cfg, hidden, vocab = _head_config(state, sizes, where)
    return head_from_tensors(cfg, hidden, vocab, state["weights"], policy, dtype, device, where)


def _check_tensors(cfg: HeadConfig, hidden: int, vocab: int, tensors: dict, where: str) -> dict:
    """The expected weights (on the meta device) after checking names, shapes and finiteness."""
    _check_finite(tensors, where)
    with torch.device("meta"):
        expected = DraftHead(cfg, hidden, vocab).state_dict()
    missing, unexpected = set(expected) - set(tensors), set(tensors) - set(expected)
    if missing or unexpected:
        raise ValueError(f"{where}: weights do not match a {cfg.kind} head: missing {sorted(missing)[:3]}, "
                         f"unexpected {sorted(unexpected)[:3]}")
    for name, t in tensors.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise ValueError(f"{where}: weight {name!r} has shape {tuple(t.shape)}, "
                             f"expected {tuple(expected[name].shape)}")
    if "draft_vocab" in tensors:  # token ids, not a weight
        check_ids(tensors["draft_vocab"], vocab, f"{where}: draft_vocab")
    return expected


def head_from_tensors(cfg: HeadConfig, hidden: int, vocab: int, tensors: dict, policy: Optional[CausalLM],
                      dtype: Optional[torch.dtype], device, where: str) -> DraftHead:
    """A head of this config with these weights, checked first; dtype and device default to the
    policy's (with no policy: the weights' own)."""
    _check_tensors(cfg, hidden, vocab, tensors, where)
    with torch.device("meta"):
        head = DraftHead(cfg, hidden, vocab)
    p = policy.lm_head.weight if policy is not None else next(iter(tensors.values()))
    dtype = dtype or p.dtype
    head = head.to_empty(device=device or p.device).to(dtype)
    head.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()})
    return head.eval()
