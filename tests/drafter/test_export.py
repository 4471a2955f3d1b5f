"""Export and load: a round trip gives the same head; the layout is vLLM's EAGLE layout, checked
against transformers' own Llama layer; a head for another policy shape or with NaN is refused."""
import json

import pytest
import torch

from drafter.export import export, load
from drafter.head import DraftHead, HeadConfig
from tests.drafter.conftest import sharp_policy


def outputs(head, policy):
    torch.manual_seed(0)
    tokens, feats = torch.randint(0, policy.cfg.vocab_size, (2, 9)), torch.randn(2, 9, policy.cfg.hidden_size)
    with torch.no_grad():
        return [t.clone() for step in head.unroll(policy, tokens, feats, 2) for t in step]


@pytest.mark.parametrize("kind", ["attention", "mlp"])
def test_round_trip(policy, tmp_path, kind):
    head = DraftHead.for_policy(policy, HeadConfig(kind=kind, intermediate_size=40), seed=1)
    export(head, tmp_path / "head")
    back = load(tmp_path / "head", policy)
    assert back.cfg == head.cfg and back.kind == kind
    for a, b in zip(outputs(head, policy), outputs(back, policy)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    bf = load(tmp_path / "head", policy, dtype=torch.bfloat16)
    assert bf.fc.weight.dtype == torch.bfloat16
    assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())


def test_eagle_layout_is_a_llama_layer_for_transformers(policy, tmp_path):
    """config.json + weights reproduce the head with transformers' LlamaDecoderLayer (input
    layernorm removed, as vLLM's EAGLE draft and EAGLE's layer 0 do): names and config keys agree."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    head = DraftHead.for_policy(policy, HeadConfig(num_heads=6, num_kv_heads=3, head_dim=16, attention_bias=True,
                                                   rope_theta=500.0), seed=2)
    export(head, tmp_path / "eagle")
    config = json.loads((tmp_path / "eagle" / "config.json").read_text())
    weights = load_file(str(tmp_path / "eagle" / "model.safetensors"))
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 1
    assert config["add_para_norm"] is True
    assert {"fc.weight", "embedding_layernorm.weight", "hidden_states_layernorm.weight",
            "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.q_proj.bias",
            "layers.0.post_attention_layernorm.weight", "layers.0.mlp.down_proj.weight"} <= set(weights)
    assert not any("input_layernorm" in k or k.startswith(("embed_tokens", "lm_head", "norm")) for k in weights)

    hf_cfg = LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "spectail_drafter")})
    hf_cfg._attn_implementation = "eager"
    layer = LlamaDecoderLayer(hf_cfg, layer_idx=0).eval()
    layer.input_layernorm = torch.nn.Identity()
    layer.load_state_dict({k[len("layers.0."):]: v for k, v in weights.items() if k.startswith("layers.0.")},
                          strict=True)
    rope = LlamaRotaryEmbedding(hf_cfg)
    tokens = torch.randint(0, policy.cfg.vocab_size, (1, 11))
    feats = torch.randn(1, 11, policy.cfg.hidden_size)
    with torch.no_grad():
        emb = policy.model.embed_tokens.weight[tokens]
        x = torch.nn.functional.linear(torch.cat(
            [_rms(emb, weights["embedding_layernorm.weight"]), _rms(feats, weights["hidden_states_layernorm.weight"])],
            -1), weights["fc.weight"])
        pos = torch.arange(11)[None]
        mask = torch.full((11, 11), float("-inf")).triu(1)[None, None]
        out = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=rope(x, pos))
        out = out[0] if isinstance(out, tuple) else out
        ours = head.unroll(policy, tokens, feats, 1)[0][0]
    torch.testing.assert_close(out, ours, atol=1e-5, rtol=1e-5)


def _rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def test_a_head_for_another_policy_shape_is_refused(policy, tmp_path):
    head = DraftHead.for_policy(policy, HeadConfig(kind="mlp"), seed=1)
    export(head, tmp_path / "h")
    with pytest.raises(ValueError, match="vocabulary 101.*the policy has 48 and 97"):
        load(tmp_path / "h", sharp_policy(vocab=97))
    with pytest.raises(ValueError, match="hidden size 48 .* the policy has 64"):
        load(tmp_path / "h", sharp_policy(hidden_size=64, intermediate_size=64))


def test_nan_weights_are_refused(policy, tmp_path):
    from safetensors.torch import load_file, save_file

    head = DraftHead.for_policy(policy, HeadConfig(), seed=1)
    export(head, tmp_path / "h")
    tensors = load_file(str(tmp_path / "h" / "model.safetensors"))
    tensors["layers.0.mlp.up_proj.weight"][0, 0] = float("nan")
    save_file(tensors, str(tmp_path / "h" / "model.safetensors"))
    with pytest.raises(ValueError, match="up_proj.weight' contains NaN"):
        load(tmp_path / "h", policy)
    with torch.no_grad():
        head.fc.weight[0, 0] = float("inf")
    with pytest.raises(ValueError, match="fc.weight' contains NaN or Inf"):
        export(head, tmp_path / "h2")
    assert not (tmp_path / "h2").exists()


def test_not_an_export_is_refused(policy, tmp_path):
    with pytest.raises(ValueError, match="not a drafter export"):
        load(tmp_path, policy)
    head = DraftHead.for_policy(policy, HeadConfig(), seed=1)
    export(head, tmp_path / "h")
    (tmp_path / "h" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load(tmp_path / "h", policy)
    (tmp_path / "h" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="no spectail_drafter section"):
        load(tmp_path / "h", policy)
    mlp = DraftHead.for_policy(policy, HeadConfig(kind="mlp"), seed=1)
    export(mlp, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["spectail_drafter"]["head"]["kind"] = "attention"
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="weights do not match a attention head"):
        load(tmp_path / "m", policy)
