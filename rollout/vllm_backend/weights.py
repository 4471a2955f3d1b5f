"""Weight updates for a running vLLM engine: checked against the checkpoint, then shipped.

vLLM's `load_weights` raises at the first name it does not know after copying the ones before
it, so the whole update is checked here first against the checkpoint's safetensors headers.
Tensors travel as (name, dtype, shape, raw bytes): vLLM's msgpack RPC would decode a bare tensor
as a plain list (vllm/v1/serial_utils.py); rollout/vllm_backend/worker.py rebuilds them.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Iterable

import torch

from ..core.model import checked_weights, read_config, weight_files


def checkpoint_layout(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor in the folder's *.safetensors (headers only), plus
    lm_head.weight when tied to the embeddings (a trainer's state dict has it)."""
    folder = Path(folder)
    layout: dict[str, tuple[int, ...]] = {}
    for f in weight_files(folder):
        with open(f, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for name, meta in header.items():
            if name != "__metadata__":
                layout[name] = tuple(meta["shape"])
    config = read_config(folder)
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
    """The update's (name, tensor) pairs, each checked against the checkpoint's layout
    (rollout.core.model.checked_weights). Raises ValueError naming the first bad tensor."""
    out = checked_weights(_as_pairs(weights), layout, ": the checkpoint has no such tensor")
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
