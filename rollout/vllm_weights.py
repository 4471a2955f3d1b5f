"""Weight updates for a running vLLM engine: checked against the checkpoint, then shipped.

A trainer's update arrives with Hugging Face names (a state dict, (name, tensor) pairs or a
module). vLLM's own `load_weights` maps those names onto its fused parameters and raises at the
first one it does not know, after it has copied the ones before it; so every name, shape and
value is checked here first, against the checkpoint folder the engine was started from (its
safetensors headers name every tensor the model has, in Hugging Face layout). Nothing is sent
unless the whole update passes.

The tensors travel to vLLM's worker as (name, dtype, shape, raw bytes): vLLM serialises a
collective_rpc's arguments with msgpack, which carries bytes natively but decodes a tensor
without type hints as a plain list (vllm/v1/serial_utils.py, MsgpackEncoder._encode_tensor).
rollout/vllm_worker.py rebuilds them on the other side.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Iterable

import torch

# Tensors a Hugging Face state dict may carry that are not weights of the checkpoint.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_layout(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor in the folder's *.safetensors (headers only, no data read),
    plus lm_head.weight when the config ties it to the embeddings (a trainer's state dict has it)."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has no *.safetensors weights")
    layout: dict[str, tuple[int, ...]] = {}
    for f in files:
        with open(f, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for name, meta in header.items():
            if name != "__metadata__":
                layout[name] = tuple(meta["shape"])
    config = json.loads((folder / "config.json").read_text())
    embed = layout.get("model.embed_tokens.weight")
    if config.get("tie_word_embeddings") and embed is not None:
        layout.setdefault("lm_head.weight", embed)
    return layout


def _as_pairs(weights) -> list[tuple[str, object]]:
    if isinstance(weights, torch.nn.Module):
        weights = weights.state_dict()
    if isinstance(weights, dict):
        weights = weights.items()
    try:
        return [(name, t) for name, t in weights]
    except (TypeError, ValueError):
        raise ValueError("weights must be a state dict, (name, tensor) pairs or a torch module") from None


def checked_update(weights, layout: dict[str, tuple[int, ...]]) -> list[tuple[str, torch.Tensor]]:
    """The update's (name, tensor) pairs, each checked against the checkpoint's layout: a known
    name, the same shape, floating point, finite. Raises ValueError naming the first bad tensor."""
    out = []
    for name, t in _as_pairs(weights):
        if not isinstance(name, str):
            raise ValueError(f"weight names must be strings, got {name!r}")
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if name not in layout:
            raise ValueError(f"unknown parameter {name!r}: the checkpoint has no such tensor "
                             f"(expected Hugging Face names like 'model.layers.0.self_attn.q_proj.weight')")
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"parameter {name!r} must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != layout[name]:
            raise ValueError(f"parameter {name!r} has shape {tuple(t.shape)}, expected {layout[name]}")
        if not t.is_floating_point():
            raise ValueError(f"parameter {name!r} has dtype {t.dtype}; weights must be floating point")
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"parameter {name!r} contains NaN or Inf")
        out.append((name, t))
    if not out:
        raise ValueError("the weight update is empty")
    return out


def pack(pairs: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, str, list[int], bytes]]:
    """(name, dtype name, shape, bytes) per tensor, on the CPU: what crosses vLLM's RPC."""
    packed = []
    for name, t in pairs:
        t = t.detach().to("cpu").contiguous()
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        packed.append((name, str(t.dtype).removeprefix("torch."), list(t.shape), raw))
    return packed


def unpack(packed, device) -> list[tuple[str, torch.Tensor]]:
    """The inverse of `pack`, on `device` (run inside vLLM's worker)."""
    pairs = []
    for name, dtype, shape, raw in packed:
        dt = getattr(torch, dtype)
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        pairs.append((name, flat.view(dt).reshape(shape).to(device)))
    return pairs
