"""The draft head: a one-layer, EAGLE-style model that predicts the policy's next hidden state.

Row j pairs the policy's final hidden state h_j with the token x_{j+1}:
x = fc(cat(embedding_layernorm(embed(x_{j+1})), hidden_states_layernorm(h_j))), out = one decoder
layer(x) ("mlp": no attention), logits = lm_head(out), predicting x_{j+2}. This is vLLM's EAGLE
layout (llama_eagle.py), so `drafter.export` writes a checkpoint vLLM loads. `embed` and `lm_head`
are the policy's own, read detached at every call: a policy update moves the head with it.
`unroll` runs whole padded sequences for several steps, each fed the head's own outputs (training);
`forward_rows` runs new rows of many requests against the head's cache (the engine's proposer).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from rollout.core.model import MLP, CausalLM, ModelConfig, RMSNorm
from rollout.kernels import pointwise_kernel
from rollout.kernels.linear import PackedLinear, bound
from rollout.kernels.ops import rotate

from .head_cache import HeadCache, Rows
from .vocab import check_ids

KINDS = ("attention", "mlp")


@dataclass(frozen=True)
class HeadConfig:
    """The head's shape; None takes the policy's value (one policy layer's shape, as EAGLE does).
    kind "mlp": no attention (cheaper; it sees only the current row). window: the attention sees the
    last `window` rows, bounding a draft's cost (None: all). draft_vocab: drafter/vocab.py."""

    kind: str = "attention"
    num_heads: Optional[int] = None
    num_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    intermediate_size: Optional[int] = None
    attention_bias: Optional[bool] = None
    rope_theta: float = 10000.0
    rms_norm_eps: Optional[float] = None
    window: Optional[int] = None
    draft_vocab: Optional[int] = None

    def resolved(self, policy_cfg: ModelConfig) -> HeadConfig:
        """Every None replaced by the policy's value; validated."""
        c = replace(self, **{k: getattr(policy_cfg, attr) for k, attr in (
            ("num_heads", "num_heads"), ("num_kv_heads", "num_kv_heads"), ("head_dim", "head_dim"),
            ("intermediate_size", "intermediate_size"), ("attention_bias", "qkv_bias"),
            ("rms_norm_eps", "rms_norm_eps")) if getattr(self, k) is None})
        c.validate()
        if c.draft_vocab is not None and c.draft_vocab > policy_cfg.vocab_size:
            raise ValueError(f"HeadConfig.draft_vocab ({c.draft_vocab}) exceeds the policy's vocabulary "
                             f"({policy_cfg.vocab_size}); use None for the whole vocabulary")
        return c

    def validate(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"HeadConfig.kind must be one of {list(KINDS)}, got {self.kind!r}")
        for name in ("num_heads", "num_kv_heads", "head_dim", "intermediate_size"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, int) and v >= 1):
                raise ValueError(f"HeadConfig.{name} must be None (the policy's) or an integer >= 1, got {v!r}")
        if self.num_heads and self.num_kv_heads and self.num_heads % self.num_kv_heads:
            raise ValueError(f"HeadConfig.num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim is not None and self.head_dim % 2:
            raise ValueError(f"HeadConfig.head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ValueError(f"HeadConfig.rope_theta must be > 0, got {self.rope_theta}")
        if self.window is not None and not (isinstance(self.window, int) and self.window >= 1):
            raise ValueError(f"HeadConfig.window must be None (all rows) or an integer >= 1, got {self.window!r}")
        v = self.draft_vocab
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"HeadConfig.draft_vocab must be None (the whole vocabulary) or an integer >= 1, "
                             f"got {v!r}")


class HeadAttention(nn.Module):
    """The attention's weights (Hugging Face / EAGLE names); the computation is the head's own."""

    def __init__(self, cfg: HeadConfig, d: int):
        super().__init__()
        hd, bias = cfg.head_dim, bool(cfg.attention_bias)
        self.q_proj = PackedLinear(d, cfg.num_heads * hd, bias=bias)
        self.k_proj = PackedLinear(d, cfg.num_kv_heads * hd, bias=bias)
        self.v_proj = PackedLinear(d, cfg.num_kv_heads * hd, bias=bias)
        self.o_proj = PackedLinear(cfg.num_heads * hd, d, bias=bias)


class HeadLayer(nn.Module):
    """One Llama decoder layer without input_layernorm (EAGLE's layer 0; "mlp": no self_attn), apart
    from rollout.core.model's so the engine's layers can change without touching the head."""

    def __init__(self, cfg: HeadConfig, d: int):
        super().__init__()
        if cfg.kind == "attention":
            self.self_attn = HeadAttention(cfg, d)
        self.mlp = MLP(d, cfg.intermediate_size, bias=False)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)

    def feed_forward(self, x: torch.Tensor, gate_up: Optional[Callable] = None) -> torch.Tensor:
        """x + mlp(norm(x)); gate_up: the gate and up projections as one call (the engine's way)."""
        h = norm(self.post_attention_layernorm, x)
        if gate_up is None:
            return x + self.mlp(h)
        gate, up = gate_up(h).chunk(2, dim=-1)
        return x + self.mlp.down_proj(F.silu(gate) * up)


def norm(module: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """An RMSNorm module's function: the engine's kernel outside autograd, else torch's rms_norm
    (one autograd call where the module makes eight)."""
    out = pointwise_kernel.rms_norm(x, module.weight, module.eps)
    if out is not None:
        return out
    if x.dtype == torch.float32 and module.weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), module.weight, module.eps)
    return module.weight * F.rms_norm(x.float(), (x.shape[-1],), None, module.eps).to(x.dtype)


@dataclass
class Packed:
    """q|k|v and gate|up as one packed matmul each (rollout.kernels.linear.bound), from the live weights."""

    version: tuple
    qkv: Optional[Callable[[torch.Tensor], torch.Tensor]]
    gate_up: Callable[[torch.Tensor], torch.Tensor]


class DraftHead(nn.Module):
    """Build with `DraftHead.for_policy(policy, HeadConfig(...))`. Parameter names are vLLM's EAGLE
    names; the policy's embed and lm_head are not among them."""

    def __init__(self, cfg: HeadConfig, hidden_size: int, vocab_size: int):
        super().__init__()
        cfg.validate()
        self.cfg, self.hidden_size, self.vocab_size = cfg, hidden_size, vocab_size
        self.fc = PackedLinear(2 * hidden_size, hidden_size, bias=False)
        self.embedding_layernorm = RMSNorm(hidden_size, cfg.rms_norm_eps)
        self.hidden_states_layernorm = RMSNorm(hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([HeadLayer(cfg, hidden_size)])
        if cfg.draft_vocab is not None and cfg.draft_vocab > vocab_size:
            raise ValueError(f"HeadConfig.draft_vocab ({cfg.draft_vocab}) exceeds the vocabulary ({vocab_size})")
        # the draft vocabulary's ids, sorted (drafter/vocab.py); the lowest ids until set_draft_vocab
        ids = None if cfg.draft_vocab is None else torch.arange(cfg.draft_vocab, dtype=torch.int64)
        self.register_buffer("draft_vocab", ids)

    @classmethod
    def for_policy(cls, policy: CausalLM, cfg: HeadConfig = HeadConfig(), dtype: Optional[torch.dtype] = None,
                   device=None, seed: Optional[int] = None) -> DraftHead:
        """A fresh head sized for this policy (dtype, device: the policy's); seed: reproducible weights."""
        cfg = cfg.resolved(policy.cfg)
        p = policy.lm_head.weight
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            head = cls(cfg, policy.cfg.hidden_size, policy.cfg.vocab_size)
        return head.to(device=device or p.device, dtype=dtype or p.dtype)

    @property
    def kind(self) -> str:
        return self.cfg.kind

    def num_parameters(self) -> int:
        """The head's own parameters (the policy's embed and lm_head it reads are not counted)."""
        return sum(p.numel() for p in self.parameters())

    def set_draft_vocab(self, ids: torch.Tensor) -> None:
        """The sorted token ids the head drafts from (drafter.vocab.frequent_tokens): rows of the
        policy's lm_head, not weights of the head, so they may change at any time."""
        if self.draft_vocab is None:
            raise ValueError("this head drafts over the whole vocabulary (HeadConfig.draft_vocab is None)")
        ids = torch.as_tensor(ids, dtype=torch.int64)
        check_ids(ids, self.vocab_size)
        if ids.numel() != self.draft_vocab.numel():
            raise ValueError(f"draft vocabulary of {ids.numel()} ids, the head's config says "
                             f"{self.draft_vocab.numel()}")
        with torch.no_grad():
            self.draft_vocab.copy_(ids)

    def check_policy(self, policy: CausalLM) -> None:
        if (policy.cfg.hidden_size, policy.cfg.vocab_size) != (self.hidden_size, self.vocab_size):
            raise ValueError(f"draft head was made for hidden size {self.hidden_size} and vocabulary "
                             f"{self.vocab_size}, the policy has {policy.cfg.hidden_size} and {policy.cfg.vocab_size}")

    # ---- pieces shared by both ways of running --------------------------------------------

    def inputs(self, policy: CausalLM, tokens: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """fc(cat(norm(embed(tokens)), norm(feats))): [..., d] in the head's dtype."""
        dtype = self.fc.weight.dtype
        embeds = F.embedding(tokens, policy.model.embed_tokens.weight.detach()).to(dtype)
        return self.fc(torch.cat((norm(self.embedding_layernorm, embeds),
                                  norm(self.hidden_states_layernorm, feats.to(dtype))), dim=-1))

    def logits(self, policy: CausalLM, out: torch.Tensor) -> torch.Tensor:
        """The head's float32 logits through the policy's live lm_head, over the draft vocabulary's rows when
        it has one (column i: token draft_vocab[i]); under autograd on detached weights."""
        if self.draft_vocab is None:
            return self.full_logits(policy, out)
        w, route = self._output_rows(policy)
        if not torch.is_grad_enabled():
            return route(out.to(w.dtype)).float()
        return F.linear(out.to(w.dtype), w).float()

    def full_logits(self, policy: CausalLM, h: torch.Tensor) -> torch.Tensor:
        """The policy's lm_head over the whole vocabulary on h, float32."""
        lm_head = policy.lm_head
        if not torch.is_grad_enabled():
            return lm_head(h.to(lm_head.weight.dtype)).float()
        w = lm_head.weight.detach()
        return F.linear(h.to(w.dtype), w).float()

    def _output_rows(self, policy: CausalLM) -> tuple[torch.Tensor, Callable]:
        """(lm_head rows of the draft vocabulary [|S|, d], their packed call), kept until the
        policy's weight or the ids change (any in-place write)."""
        w, ids = policy.lm_head.weight, self.draft_vocab
        key = (id(w), w.data_ptr(), _version(w), ids.data_ptr(), _version(ids), w.dtype, w.device)
        cached = getattr(self, "_vocab_rows", None)
        if cached is not None and cached[0] == key and None not in key:
            return cached[1], cached[2]
        with torch.inference_mode(False), torch.no_grad():  # an ordinary tensor: training reads it too
            rows = w.detach().index_select(0, ids.to(w.device)).contiguous()
            route = bound(rows)
        self._vocab_rows = (key, rows, route)
        return rows, route

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [..., 1, head_dim] for positions of any shape (float32 math: no rounded buffer)."""
        dim = self.cfg.head_dim
        inv_freq = 1.0 / self.cfg.rope_theta ** (torch.arange(0, dim, 2, device=positions.device).float() / dim)
        freqs = positions[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[..., None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    # ---- the engine's way: new rows against the head's KV cache -------------------------

    def new_cache(self, num_slots: int, max_len: int, max_draft: int = 64) -> Optional[HeadCache]:
        """The head's cache (None for "mlp") for positions below max_len, drafts of max_draft tokens."""
        if self.kind != "attention":
            return None
        p = self.fc.weight
        cos, sin = self.rope(torch.arange(max_len, device=p.device), p.dtype)
        kept = max_len if self.cfg.window is None else min(self.cfg.window + max_draft, max_len)
        half = self.cfg.head_dim // 2
        sin_signed = torch.cat([-sin[:, 0, :half], sin[:, 0, half:]], dim=-1)
        return HeadCache.new(num_slots, self.cfg.num_kv_heads, kept, self.cfg.head_dim, cos[:, 0], sin_signed,
                             self.cfg.window)

    @torch.inference_mode()
    def forward_rows(self, policy: CausalLM, cache: Optional[HeadCache], rows: Rows,
                     packed: Optional[Packed] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """New rows of some requests: every row's key and value is written, each request's last row
        attends. Returns (out [C, d], logits [C, V] float32) of those; packed: `self.packed()`."""
        x = self.inputs(policy, rows.tokens, rows.feats)
        layer, packed = self.layers[0], self.packed() if packed is None else packed
        if self.kind != "attention":
            out = layer.feed_forward(x if rows.all_last else x[rows.last], packed.gate_up)
            return out, self.logits(policy, out)
        attn, cfg, n = layer.self_attn, self.cfg, x.shape[0]
        heads, kv = cfg.num_heads, cfg.num_kv_heads
        qkv = packed.qkv(x).view(n, heads + 2 * kv, cfg.head_dim)
        attended = cache.attend_rows(qkv, heads, rows)
        last = x if rows.all_last else x[rows.last]
        out = layer.feed_forward(last + attn.o_proj(attended), packed.gate_up)
        return out, self.logits(policy, out)

    def packed(self) -> Packed:
        """q|k|v and gate|up packed, remade whenever a weight changed (a training step)."""
        layer = self.layers[0]
        mlp, attn = layer.mlp, getattr(layer, "self_attn", None)
        parts = [mlp.gate_proj.weight, mlp.up_proj.weight]
        if attn is not None:
            parts += [t for m in (attn.q_proj, attn.k_proj, attn.v_proj) for t in (m.weight, m.bias) if t is not None]
        version = tuple((id(t), t.data_ptr(), t._version) for t in parts)  # (a .to() moves data_ptr)
        cached = getattr(self, "_packed", None)
        if cached is not None and cached.version == version:
            return cached
        with torch.no_grad():
            qkv = None
            if attn is not None:
                qkv_b = None
                if attn.q_proj.bias is not None:
                    qkv_b = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
                qkv = bound(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), qkv_b)
            self._packed = Packed(version, qkv, bound(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])))
        return self._packed

    def __getstate__(self):
        # A copy packs again on first use (a pack may hold a library handle, which does not pickle).
        state = super().__getstate__()
        state.pop("_packed", None)
        state.pop("_vocab_rows", None)
        return state

    # ---- the trainer's way: padded sequences, unrolled ------------------------------------

    def unroll(self, policy: CausalLM, tokens: torch.Tensor, feats: torch.Tensor, steps: int,
               pick: Optional[Callable[[int, torch.Tensor], torch.Tensor]] = None,
               with_logits: bool = True) -> list[tuple]:
        """tokens [B, L] (row j: x_{j+1}), feats [B, L, d] (h_j), right-padded. Per step s: (out, float32
        logits or None); step s >= 1 feeds row j step s - 1's output at j - 1 and x_{j+1} or pick's draft."""
        if pick is not None and not with_logits:
            raise ValueError("unroll: pick reads each step's logits, so it needs with_logits")
        b, length = tokens.shape
        cos, sin = self.rope(torch.arange(length, device=tokens.device), self.fc.weight.dtype)
        keys, values, results = [], [], []
        tok, fin = tokens, feats
        for s in range(steps):
            x = self.inputs(policy, tok, fin)
            layer = self.layers[0]
            if self.kind == "attention":
                x = x + self._attend_unrolled(layer.self_attn, x, cos, sin, keys, values)
            out = layer.feed_forward(x)
            logits = self.logits(policy, out) if with_logits else None
            results.append((out, logits))
            if s + 1 < steps:
                fin = _shift_right(out)
                if pick is not None:
                    tok = _shift_right(pick(s, logits))
        return results

    def _attend_unrolled(self, attn, x, cos, sin, keys: list, values: list) -> torch.Tensor:
        """Attention of step s = len(keys): step-0 keys of rows <= j - s, and the key step m wrote at
        row j - s + m (m = 1..s). Appends this step's keys and values."""
        cfg = self.cfg
        b, length, _ = x.shape
        rep = cfg.num_heads // cfg.num_kv_heads
        q = rotate(attn.q_proj(x).view(b, length, cfg.num_heads, cfg.head_dim), cos, sin)
        k = rotate(attn.k_proj(x).view(b, length, cfg.num_kv_heads, cfg.head_dim), cos, sin)
        v = attn.v_proj(x).view(b, length, cfg.num_kv_heads, cfg.head_dim)
        keys.append(k.repeat_interleave(rep, dim=2))
        values.append(v.repeat_interleave(rep, dim=2))
        s = len(keys) - 1
        scale = 1.0 / math.sqrt(cfg.head_dim)
        rows = torch.arange(length, device=x.device)
        scores = torch.einsum("blhd,bmhd->bhlm", q, keys[0]).float() * scale
        hidden = rows[None, :] > rows[:, None] - s
        if cfg.window is not None:  # row j sees positions (j - window, j]
            hidden |= rows[None, :] <= rows[:, None] - cfg.window
        scores = scores.masked_fill(hidden, float("-inf"))
        diag = []
        for m in range(1, s + 1):
            shifted = _shift_right(keys[m], s - m)
            d = (q * shifted).sum(-1).float() * scale  # [B, L, H]
            gone = (rows < s - m) | (cfg.window is not None and s - m >= cfg.window)
            diag.append(d.masked_fill(gone[None, :, None], float("-inf")).permute(0, 2, 1)[..., None])
        weights = torch.softmax(torch.cat([scores] + diag, dim=-1), dim=-1).to(x.dtype)
        out = torch.einsum("bhlm,bmhd->blhd", weights[..., :length], values[0])
        for m in range(1, s + 1):
            out = out + weights[..., length + m - 1].permute(0, 2, 1)[..., None] * _shift_right(values[m], s - m)
        return attn.o_proj(out.reshape(b, length, -1))


def _version(t: torch.Tensor) -> Optional[int]:
    """t's in-place write counter; None for an inference tensor, which has none (never cached)."""
    try:
        return t._version
    except RuntimeError:
        return None


def _shift_right(t: torch.Tensor, n: int = 1) -> torch.Tensor:
    """t[:, j] <- t[:, j - n] along dim 1; the first n rows are zeros (never read unmasked)."""
    if n == 0:
        return t
    return torch.cat([torch.zeros_like(t[:, :n]), t[:, :-n]], dim=1)
