"""Our own implementation of the Llama family (Llama, Qwen2, Qwen3, Mistral) for the engine.

Modules carry Hugging Face parameter names, so a checkpoint's state dict loads as is and a
trainer's named parameters can be pushed with `load_weights`. The forward takes a ragged
ForwardBatch against the slot-based KVCache and returns float32 logits for the requested
tokens and the final hidden states at those tokens (the drafter trains on them).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import ops
from ..kernels.linear import PackedLinear
from .batch import MIN_BUCKET, AttentionGroup, ForwardBatch
from .kv_cache import KVCache

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")
# bfloat16 attention on the CPU gives a query the same bits in grids of at least MIN_QUERIES
# queries per row that read the same number of keys, a multiple of KEY_STEP (docs/dtypes.md).
MIN_QUERIES = 4
KEY_STEP = 16


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2; Llama's attention_bias
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3
    sliding_windows: tuple  # per layer: window size or None
    max_position_embeddings: int


def config_from_hf(hf) -> ModelConfig:
    """Read a transformers config (any version) into ours; reject what we do not implement."""
    arch = getattr(hf, "model_type", None)
    if arch not in SUPPORTED:
        raise ValueError(f"unsupported architecture {arch!r}; spectail's engine supports {list(SUPPORTED)}")
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    n = hf.num_hidden_layers
    window = getattr(hf, "sliding_window", None)
    if arch == "mistral" or not window:
        layer_types = ["sliding_attention" if window else "full_attention"] * n
    else:
        layer_types = getattr(hf, "layer_types", None) or ["full_attention"] * n
    windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
    attention_bias = bool(getattr(hf, "attention_bias", False))
    return ModelConfig(
        arch=arch, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, num_layers=n,
        num_heads=heads, num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
        head_dim=head_dim, intermediate_size=hf.intermediate_size, rms_norm_eps=hf.rms_norm_eps,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2" or attention_bias, o_bias=attention_bias and arch != "qwen2",
        mlp_bias=bool(getattr(hf, "mlp_bias", False)), qk_norm=arch == "qwen3",
        sliding_windows=windows, max_position_embeddings=hf.max_position_embeddings)


def rope_inv_freq(hf) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and cos/sin scaling, computed by transformers' own RoPE init
    functions so every static RoPE variant (default, linear, llama3, yarn) matches exactly."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        dim = int(dim * getattr(hf, "partial_rotary_factor", 1.0))
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    if rope_type in ("dynamic", "longrope") or rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"RoPE type {rope_type!r} is not supported (its frequencies depend on the sequence "
                         f"length); supported: default, linear, llama3, yarn")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
    return inv_freq.float(), float(scaling)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


def keys_read(kv_len: int) -> int:
    return -(-kv_len // KEY_STEP) * KEY_STEP


def invariant_grid(group: AttentionGroup, cache_len: int) -> AttentionGroup:
    """The group's grid with at least MIN_QUERIES queries per row and its whole context bucket's keys:
    torch's bfloat16 CPU attention rounds 1-3 queries per row differently and blocks by key count."""
    bucket = max(MIN_BUCKET, 1 << (group.kv_len - 1).bit_length())
    length, kv_len = max(group.max_row_len, MIN_QUERIES), min(bucket, cache_len)
    if length == group.max_row_len and kv_len == group.kv_len:
        return group
    old = group.max_row_len
    return dataclasses.replace(group, pad_index=group.pad_index // old * length + group.pad_index % old,
                               query_pos=F.pad(group.query_pos, (0, length - old), value=-1),
                               max_row_len=length, kv_len=kv_len)


@dataclass(frozen=True)
class Grids:
    """torch's attention for one forward: the batch's grids, made invariant on the CPU in
    bfloat16, and each grid's mask per sliding window (keyed (grid index, window))."""

    groups: list
    masks: dict

    @staticmethod
    def of(batch: ForwardBatch, cache: KVCache, windows: tuple) -> Grids:
        groups = batch.groups
        if cache.k[0].dtype == torch.bfloat16 and cache.k[0].device.type == "cpu":
            groups = [invariant_grid(g, cache.max_len) for g in groups]
        return Grids(groups, {(g, w): group.mask(w) for g, group in enumerate(groups) for w in set(windows)})


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, window: Optional[int]):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = PackedLinear(d, cfg.num_heads * hd, bias=cfg.qkv_bias)
        self.k_proj = PackedLinear(d, cfg.num_kv_heads * hd, bias=cfg.qkv_bias)
        self.v_proj = PackedLinear(d, cfg.num_kv_heads * hd, bias=cfg.qkv_bias)
        self.o_proj = PackedLinear(cfg.num_heads * hd, d, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.cfg, self.window = cfg, window

    def forward(self, x, cos, sin, batch: ForwardBatch, cache: KVCache, layer: int, grids: Optional[Grids]):
        cfg, n = self.cfg, x.shape[0]
        q = self.q_proj(x).view(n, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x).view(n, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x).view(n, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = ops.rotate(q, cos, sin), ops.rotate(k, cos, sin)
        cache.write(layer, batch.token_slots, batch.positions, k, v)
        if grids is None:  # the CPU kernel
            o = ops.attend(q, cache.k[layer], cache.v[layer], batch.token_slots, batch.positions, self.window)
            return self.o_proj(o.view(n, -1))

        out = q.new_empty(n, cfg.num_heads * cfg.head_dim)
        # CUDA's fused attention kernels take grouped KV heads in half precision only; in float32
        # with enable_gqa it falls back to the math path (a dozen kernels a call, launch-bound at
        # decode sizes). Expanding the heads there keeps the memory-efficient kernel.
        expand = cfg.num_heads // cfg.num_kv_heads if q.is_cuda and cfg.num_heads != cfg.num_kv_heads else 1
        for g, group in enumerate(grids.groups):
            rows, length = group.num_rows, group.max_row_len
            # index_select / index_copy_ move the same data as indexing with [...], faster on the CPU
            grid = q.new_zeros(rows * length, cfg.num_heads, cfg.head_dim)
            grid.index_copy_(0, group.pad_index, q.index_select(0, group.token_index))
            grid = grid.view(rows, length, cfg.num_heads, cfg.head_dim).transpose(1, 2)
            keys, values = cache.read(layer, group.slots, group.first_slot, group.kv_len)
            if expand > 1:
                keys, values = keys.repeat_interleave(expand, 1), values.repeat_interleave(expand, 1)
            o = F.scaled_dot_product_attention(grid, keys, values, attn_mask=grids.masks[g, self.window],
                                               enable_gqa=expand == 1 and cfg.num_heads != cfg.num_kv_heads)
            o = o.transpose(1, 2).reshape(rows * length, -1)
            out.index_copy_(0, group.token_index, o.index_select(0, group.pad_index))
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, d: int, inner: int, bias: bool):
        super().__init__()
        self.gate_proj = PackedLinear(d, inner, bias=bias)
        self.up_proj = PackedLinear(d, inner, bias=bias)
        self.down_proj = PackedLinear(inner, d, bias=bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, window: Optional[int]):
        super().__init__()
        self.self_attn = Attention(cfg, window)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, batch, cache, layer, grids):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, cache, layer, grids)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, w) for w in cfg.sliding_windows)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """The engine's model. Build with `CausalLM.from_pretrained`."""

    def __init__(self, cfg: ModelConfig, inv_freq: torch.Tensor, rope_scaling: float = 1.0):
        super().__init__()
        self.cfg = cfg
        self.weights_version = 0  # updates by the engine (Engine.update_weights): proposers' state is made under one
        self.model = Backbone(cfg)
        self.lm_head = PackedLinear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rope_scaling = rope_scaling

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (logits [M, V] float32 for the tokens in batch.logit_index, final hidden states
        [H, d] for those in batch.hidden_index, which defaults to the logit rows)."""
        x = self.model.embed_tokens(batch.token_ids)
        freqs = batch.positions[:, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos = (emb.cos() * self.rope_scaling).to(x.dtype)
        sin = (emb.sin() * self.rope_scaling).to(x.dtype)
        grids = None if self.attends_in_kernel(cache) else Grids.of(batch, cache, self.cfg.sliding_windows)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, batch, cache, i, grids)
        hidden = self.model.norm(x[batch.logit_index])
        logits = self.lm_head(hidden).float()
        if batch.hidden_index is not None:
            hidden = self.model.norm(x[batch.hidden_index])
        return logits, hidden

    def attends_in_kernel(self, cache: KVCache) -> bool:
        """Whether attention over this cache runs in the CPU kernel (else torch's, on grids)."""
        return cache.keys_transposed

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        p = self.lm_head.weight
        kernel = ops.attention_in_kernel(p.device, p.dtype, self.cfg.num_heads, self.cfg.num_kv_heads)
        # room for a grid's keys rounded up to KEY_STEP at the longest context
        return KVCache(self.cfg.num_layers, num_slots, keys_read(max_len), self.cfg.num_kv_heads,
                       self.cfg.head_dim, p.dtype, p.device, keys_transposed=kernel)

    # ---- weights -------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, model_or_path, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> CausalLM:
        """A local Hugging Face checkpoint folder, an in-memory transformers causal LM, or a
        (Hugging Face config, state dict) pair (say a merged PEFT policy's weights)."""
        if isinstance(model_or_path, (str, Path)):
            hf_config, tensors = _read_checkpoint(Path(model_or_path))
        elif isinstance(model_or_path, nn.Module) and hasattr(model_or_path, "config"):
            hf_config, tensors = model_or_path.config, model_or_path.state_dict()
        elif isinstance(model_or_path, tuple) and len(model_or_path) == 2 and isinstance(model_or_path[1], dict):
            hf_config, tensors = model_or_path
        else:
            raise ValueError("model_or_path must be a checkpoint folder, a transformers model or a (config, state "
                             f"dict) pair, got {type(model_or_path).__name__}")
        cfg = config_from_hf(hf_config)
        inv_freq, scaling = rope_inv_freq(hf_config)
        with torch.device("meta"):
            model = cls(cfg, inv_freq, scaling)
        model = model.to_empty(device=device).to(dtype)
        model.inv_freq = inv_freq.to(device)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        missing = set(model.state_dict()) - set(tensors)
        if cfg.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} parameters, e.g. {sorted(missing)[:3]}")
        model.load_weights(tensors.items())
        return model.eval()

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy Hugging Face-named tensors in, all or nothing: every one is checked
        (`checked_weights`) before the first copy, so a bad update leaves the weights untouched."""
        params = dict(self.named_parameters(remove_duplicate=False))
        checked = checked_weights(named, {n: tuple(p.shape) for n, p in params.items()}, f" for {self.cfg.arch}")
        with torch.no_grad():
            for name, t in checked:
                params[name].copy_(t)
        return len(checked)


def checked_weights(named, shapes: dict, unknown: str) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a weight update, rotary buffers left out, each checked (a known name:
    `unknown` says whose; its shape; floating point; finite): a ValueError names the first bad one."""
    out = []
    for name, t in named:
        if not isinstance(name, str):
            raise ValueError(f"weight names must be strings, got {name!r}")
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name not in shapes:
            raise ValueError(f"unknown parameter {name!r}{unknown} "
                             f"(expected Hugging Face names like 'model.layers.0.self_attn.q_proj.weight')")
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"parameter {name!r} must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != shapes[name]:
            raise ValueError(f"parameter {name!r} has shape {tuple(t.shape)}, expected {shapes[name]}")
        if not t.is_floating_point():
            raise ValueError(f"parameter {name!r} has dtype {t.dtype}; weights must be floating point")
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"parameter {name!r} contains NaN or Inf")
        out.append((name, t))
    return out


def read_config(folder: Path) -> dict:
    """A Hugging Face checkpoint folder's config.json (ValueError where there is none)."""
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder} is not a Hugging Face checkpoint folder (no config.json)")
    return json.loads((folder / "config.json").read_text())


def weight_files(folder: Path) -> list[Path]:
    """A checkpoint folder's *.safetensors files (ValueError where there is none)."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has no *.safetensors weights")
    return files


def _read_checkpoint(folder: Path):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    model_type = read_config(folder).get("model_type")
    if model_type not in SUPPORTED:
        raise ValueError(f"unsupported architecture {model_type!r}; spectail's engine supports {list(SUPPORTED)}")
    hf_config = AutoConfig.from_pretrained(folder, local_files_only=True)
    return hf_config, {name: t for f in weight_files(folder) for name, t in load_file(str(f)).items()}
