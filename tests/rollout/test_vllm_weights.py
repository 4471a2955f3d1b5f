"""The parts of the vLLM backend that need no vLLM: weight-update validation against the
checkpoint, the byte packing that crosses vLLM's RPC, architecture and option checks."""
import json
import sys

import pytest
import torch

from rollout import vllm_backend
from rollout.vllm_weights import checked_update, checkpoint_layout, pack, unpack
from tests.conftest import tiny_hf_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt")
    model = tiny_hf_model("qwen2")  # tied embeddings: the checkpoint has no lm_head.weight
    model.save_pretrained(folder)
    return folder, model


def test_layout_names_every_tensor_with_its_shape(saved):
    folder, model = saved
    layout = checkpoint_layout(folder)
    state = model.state_dict()
    assert set(layout) == set(state)  # lm_head.weight added for the tied checkpoint
    assert all(layout[k] == tuple(v.shape) for k, v in state.items())


def test_a_whole_state_dict_passes(saved):
    folder, model = saved
    pairs = checked_update(model, checkpoint_layout(folder))
    assert len(pairs) == len(model.state_dict())


@pytest.mark.parametrize("bad, message", [
    ({"model.nope.weight": torch.zeros(2)}, "unknown parameter 'model.nope.weight'"),
    ({"model.norm.weight": torch.zeros(3)}, "has shape (3,), expected (48,)"),
    ({"model.norm.weight": torch.zeros(48, dtype=torch.int64)}, "floating point"),
    ({"model.norm.weight": torch.full((48,), float("nan"))}, "NaN or Inf"),
    ({"model.norm.weight": [0.0] * 48}, "must be a torch.Tensor"),
    ({}, "empty"),
])
def test_a_bad_update_names_the_tensor(saved, bad, message):
    folder, model = saved
    update = {"model.embed_tokens.weight": model.model.embed_tokens.weight.detach(), **bad}
    if not bad:
        update = {}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        checked_update(update, checkpoint_layout(folder))


def test_rotary_buffers_are_skipped(saved):
    folder, _ = saved
    pairs = checked_update({"model.rotary_emb.inv_freq": torch.ones(6), "model.norm.weight": torch.ones(48)},
                           checkpoint_layout(folder))
    assert [n for n, _ in pairs] == ["model.norm.weight"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pack_unpack_round_trip(dtype):
    t = torch.randn(3, 5).to(dtype)
    packed = pack([("a", t), ("b", t[:, 1])])  # a non-contiguous view too
    assert all(isinstance(raw, bytes) for *_, raw in packed)
    (na, a), (nb, b) = unpack(packed, "cpu")
    assert (na, nb) == ("a", "b")
    assert a.dtype == dtype and torch.equal(a, t) and torch.equal(b, t[:, 1])


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"]}))
    with pytest.raises(ValueError, match="unsupported architecture.*FooForCausalLM"):
        vllm_backend.check_architecture(tmp_path, ["LlamaForCausalLM"])
    with pytest.raises(ValueError, match="no config.json"):
        vllm_backend.check_architecture(tmp_path / "missing", ["LlamaForCausalLM"])


def test_speculation_options():
    assert vllm_backend.speculative_config(None, 4) is None
    assert vllm_backend.speculative_config("suffix", 4)["method"] == "suffix"
    with pytest.raises(ValueError, match="speculation must be None or one of"):
        vllm_backend.speculative_config("eagle", 4)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        vllm_backend.speculative_config("ngram", 0)


def test_missing_vllm_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # what `import vllm` sees where it is not installed
    with pytest.raises(ImportError, match="make venv-vllm"):
        vllm_backend.import_vllm()
