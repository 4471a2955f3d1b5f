"""The parts of the vLLM backend that need no vLLM: weight-update validation against the
checkpoint, the byte packing that crosses vLLM's RPC, architecture, head size and option checks,
in-memory policies written as checkpoints, per-chunk seeds."""
import json
import os
import shutil
import sys

import pytest
import torch

from rollout.vllm_backend import backend as vllm_backend
from rollout.vllm_backend import checkpoint as vllm_checkpoint
from rollout.vllm_backend.config import VllmConfig
from rollout.vllm_backend.weights import checked_update, checkpoint_layout, pack, unpack
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
        vllm_checkpoint.check_architecture(tmp_path, ["LlamaForCausalLM"])
    with pytest.raises(ValueError, match="no config.json"):
        vllm_checkpoint.check_architecture(tmp_path / "missing", ["LlamaForCausalLM"])


def test_head_size_outside_vllms_cpu_attention_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 32, "num_attention_heads": 2}))
    with pytest.raises(ValueError, match="head size is 16.*does not implement"):
        vllm_checkpoint.check_head_size(tmp_path, [32, 64, 128])
    vllm_checkpoint.check_head_size(tmp_path, None)  # no CPU attention backend to ask: vLLM decides
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 128, "num_attention_heads": 4}))
    vllm_checkpoint.check_head_size(tmp_path, [32, 64, 128])  # the demo policy's shape


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_in_memory_policies_become_checkpoint_folders(arch, tmp_path):
    """A module, or the (config, state dict) pair Ray workers receive (a config that was never
    saved names no architecture), written as a folder whose layout is the model's own."""
    model = tiny_hf_model(arch)
    assert not model.config.architectures
    for source in ((model.config, model.state_dict()), model):  # (save_pretrained names it in the module)
        folder, tmp = vllm_checkpoint.materialise(source)
        try:
            config = json.loads((folder / "config.json").read_text())
            assert config["architectures"] == [f"{arch.capitalize()}ForCausalLM"]
            layout = checkpoint_layout(folder)
            assert layout == {k: tuple(v.shape) for k, v in model.state_dict().items()}
        finally:
            shutil.rmtree(tmp)
        if isinstance(source, tuple):
            assert not model.config.architectures  # the caller's config is left alone
    folder, tmp = vllm_checkpoint.materialise(str(tmp_path))
    assert folder == tmp_path and tmp is None  # a folder is used as it is
    with pytest.raises(ValueError, match="checkpoint folder, a transformers model"):
        vllm_checkpoint.materialise(42)


def test_continued_chunks_draw_fresh_seeds():
    assert vllm_backend.chunk_seed(123, 0) == 123  # an unchunked sample keeps its own seed
    seeds = {vllm_backend.chunk_seed(123, p) for p in range(1, 200)} | {vllm_backend.chunk_seed(124, 5)}
    assert len(seeds) == 200 and all(0 <= s < 2**63 for s in seeds)
    assert vllm_backend.chunk_seed(123, 7) == vllm_backend.chunk_seed(123, 7)  # a requeued chunk repeats


def test_cpu_binding_spreads_workers_over_cores():
    cores = sorted(os.sched_getaffinity(0))
    assert vllm_backend.cpu_binding(1, 0) == str(cores[0])
    assert vllm_backend.cpu_binding(1, 1) == str(cores[1 % len(cores)])
    assert vllm_backend.cpu_binding(None) == ",".join(map(str, cores))


@pytest.mark.parametrize("field, value, message", [
    ("speculation", "eagle", "speculation must be null or one of"),
    ("num_speculative_tokens", 0, "num_speculative_tokens must be an integer >= 1"),
    ("kv_cache_gib", 0, "kv_cache_gib"),
    ("gpu_memory_utilization", 1.5, "gpu_memory_utilization"),
    ("python", " ", "python must be null or an interpreter path"),
])
def test_vllm_config_names_the_bad_field(field, value, message):
    with pytest.raises(ValueError, match=f"VllmConfig.{message}"):
        VllmConfig(**{field: value}).validate()
    VllmConfig().validate()


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


def test_sampled_speculation_is_refused_only_where_vllm_cpu_is_broken():
    problem = vllm_backend.sampled_speculation_problem
    assert "#55005" in problem(True, "0.32.0") and "speculation=null" in problem(True, "0.31.0")
    assert problem(True, "0.32.1") is None and problem(True, "0.33.0.dev4+gabc") is None  # a later release
    assert problem(False, "0.32.0") is None  # on a GPU vLLM runs its Triton kernels
