"""The vLLM backend against transformers and spectail's engine, on one shared vLLM engine (a start
costs tens of seconds): logprobs, weight updates without restart, refused bad updates, seeds,
chunked continuation, lengths. The engine is started from the in-memory model (written to a
temporary folder first). Runs where vLLM is installed (`make test-vllm` creates .venv-vllm)."""
import os
import signal
import tempfile
import threading
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed in this environment: `make test-vllm` "
                           "creates .venv-vllm and runs tests/vllm there")

from rollout import Engine, EngineConfig, SamplingParams, SpecConfig  # noqa: E402
from rollout.core.request import make_requests  # noqa: E402
from rollout.core.sampling import token_logprobs  # noqa: E402
from rollout.vllm_backend import VllmBackend, engine_exit  # noqa: E402
from rollout.vllm_backend.config import VllmConfig  # noqa: E402
from tests.conftest import tiny_hf_model  # noqa: E402

VOCAB = 128
# head_dim 32: the smallest head size vLLM's CPU attention implements (vllm/v1/attention/backends/cpu_attn.py)
SHAPE = dict(vocab=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1)
CONFIG = EngineConfig(max_batch_size=8, max_model_len=128, max_num_batched_tokens=256, num_threads=1)
EAGER = VllmConfig(compile=False)  # a faster start
PROMPTS = [[3, 17, 42, 5, 9], [7, 7, 8, 100, 2, 64, 11], [1, 2, 3], [90, 80, 70, 60, 50, 40]]


@pytest.fixture(scope="module")
def models():
    return tiny_hf_model("llama", seed=0, **SHAPE), tiny_hf_model("llama", seed=1, **SHAPE)


@pytest.fixture(scope="module")
def backend(models):
    b = VllmBackend(models[0], CONFIG, EAGER)  # in memory: saved to a temporary folder, removed at shutdown
    folder = b.folder
    assert (folder / "config.json").is_file()
    yield b
    b.shutdown()
    assert not folder.exists()


def greedy_spectail(model, n=12):
    engine = Engine.from_pretrained(model, EngineConfig(max_batch_size=8, max_model_len=128))
    return [o.token_ids for o in engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=n),
                                                 seeds=list(range(len(PROMPTS))))]


def greedy_vllm(backend, n=12):
    outs = backend.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=n), seeds=list(range(len(PROMPTS))))
    return [o.token_ids for o in outs]


def test_logprobs_are_the_processed_distribution_of_transformers(backend, models):
    backend.update_weights(models[0])
    params = [SamplingParams(temperature=0.7, max_tokens=10), SamplingParams(temperature=1.0, max_tokens=10, top_k=20),
              SamplingParams(temperature=1.3, max_tokens=10), SamplingParams(temperature=0.0, max_tokens=10)]
    outs = backend.generate(PROMPTS, params, seeds=[11, 12, 13, 14])
    for prompt, p, out in zip(PROMPTS, params, outs):
        assert len(out.token_ids) == len(out.logprobs) == 10 and out.finish_reason == "length"
        ids = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            logits = models[0](ids).logits[0, len(prompt) - 1:-1].float()
        m = len(out.token_ids)
        expected = token_logprobs(logits, torch.full((m,), p.temperature), torch.full((m,), p.top_k, dtype=torch.long),
                                  torch.full((m,), p.top_p), torch.tensor(out.token_ids))
        assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-3), (p, out.logprobs, expected.tolist())


def test_weight_update_changes_outputs_as_the_new_weights_dictate(backend, models):
    backend.update_weights(models[0])
    before = greedy_vllm(backend)
    assert before == greedy_spectail(models[0])
    loaded = backend.update_weights(models[1].state_dict())
    assert loaded == len(models[1].state_dict())
    after = greedy_vllm(backend)
    assert after == greedy_spectail(models[1])
    assert after != before
    assert backend.metrics()["weight_update_seconds"] > 0


@pytest.mark.parametrize("bad", [
    {"model.layers.0.mlp.up_proj.weight": "zeros", "model.nope.weight": torch.zeros(3)},
    {"model.layers.0.mlp.up_proj.weight": "zeros", "model.norm.weight": torch.zeros(65)},
    {"model.layers.0.mlp.up_proj.weight": "zeros", "model.norm.weight": torch.full((64,), float("inf"))},
])
def test_bad_update_is_refused_whole_and_the_engine_still_works(backend, models, bad):
    backend.update_weights(models[1])
    expected = greedy_spectail(models[1])
    update = {k: torch.zeros(128, 64) if isinstance(v, str) else v for k, v in bad.items()}
    with pytest.raises(ValueError, match="model.nope.weight|model.norm.weight"):
        backend.update_weights(update)
    assert greedy_vllm(backend) == expected  # the valid first tensor was not copied either


def test_stop_token_ends_a_request_as_in_spectail(backend, models):
    backend.update_weights(models[0])
    ref = greedy_spectail(models[0])[0]
    stop = next(t for i, t in enumerate(ref) if i >= 2 and t not in ref[:i])
    out = backend.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop]),
                           seeds=[0])[0]
    assert out.finish_reason == "stop" and out.token_ids == ref[:ref.index(stop) + 1]


def test_seeds_reproduce_vllms_own_samples(backend, models):
    backend.update_weights(models[0])
    params = SamplingParams(temperature=1.0, max_tokens=16)
    seeds = [101, 202, 303, 404]
    first = backend.generate(PROMPTS, params, seeds=seeds)
    again = backend.generate(PROMPTS, params, seeds=seeds)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    alone = backend.generate(PROMPTS[1:2], params, seeds=seeds[1:2])[0]
    assert alone.token_ids == first[1].token_ids  # batch composition does not change a seeded sample
    other = backend.generate(PROMPTS, params, seeds=[s + 1 for s in seeds])
    assert [o.token_ids for o in other] != [o.token_ids for o in first]
    assert [o.seed for o in first] == seeds
    assert all(o.stats["forward_passes"] == 15 for o in first)
    assert 16 <= backend.metrics()["engine_steps"] <= 32  # a prefill and 15 decode steps, or chunked more


def test_bad_generate_input_is_refused(backend):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        backend.generate([[VOCAB + 5]], SamplingParams(max_tokens=2), seeds=[0])
    with pytest.raises(ValueError, match="seeds has 2 entries for 1 prompts"):
        backend.generate([[1, 2]], SamplingParams(max_tokens=2), seeds=[0, 1])
    with pytest.raises(ValueError, match="max_model_len"):
        backend.generate([[1] * 128], SamplingParams(max_tokens=2), seeds=[0])
    with pytest.raises(ValueError, match="groups"):
        backend.generate([[1, 2]], SamplingParams(max_tokens=2), seeds=[0], groups=[[1]])
    assert len(backend.generate([[1, 2]], SamplingParams(max_tokens=2), seeds=[0])[0].token_ids) == 2


def test_seeded_prompts_longer_than_one_steps_token_budget(backend, models):
    """8 prompts of 100 tokens (800 > max_num_batched_tokens 256): vLLM must not prefill a seeded
    request in parts (its CPU generator cannot be rewound, which killed the engine)."""
    backend.update_weights(models[0])
    prompts = [[(7 * i + j) % VOCAB for j in range(100)] for i in range(8)]
    params = SamplingParams(temperature=1.0, max_tokens=8)
    outs = backend.generate(prompts, params, seeds=list(range(8)))
    assert all(len(o.token_ids) == 8 for o in outs)
    again = backend.generate(prompts, params, seeds=list(range(8)))
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]


def test_max_model_len_ends_a_request_with_length_as_in_spectail(backend, models):
    backend.update_weights(models[0])
    prompt = list(range(1, 121))
    out = backend.generate([prompt], SamplingParams(temperature=0.0, max_tokens=50), seeds=[0])[0]
    engine = Engine.from_pretrained(models[0], EngineConfig(max_batch_size=8, max_model_len=128))
    ref = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=50), seeds=[0])[0]
    assert out.finish_reason == ref.finish_reason == "length" and len(out.token_ids) == 128 - 120
    assert out.token_ids == ref.token_ids


def test_chunks_continue_a_request(backend, models):
    """run(max_new_tokens=k) pauses every request after k tokens; continuing it gives the
    unchunked greedy tokens, and sampled chunks draw fresh noise (a later chunk does not replay
    the first chunk's draws)."""
    backend.update_weights(models[0])
    greedy = SamplingParams(temperature=0.0, max_tokens=20)
    reqs = make_requests(VOCAB, CONFIG.max_model_len, PROMPTS, greedy, [0, 1, 2, 3])
    calls = 0
    while any(r.finish_reason is None for r in reqs):
        info = backend.run([r for r in reqs if r.finish_reason is None], max_new_tokens=6)
        calls += 1
        assert info.engine_steps > 0 and info.fed_tokens > 0
    assert calls == 4 and [r.output_ids for r in reqs] == greedy_spectail(models[0], n=20)
    assert all(r.forward_passes == 20 - 4 for r in reqs)  # every chunk's first token comes from its prefill
    sampled = SamplingParams(temperature=1.0, max_tokens=12)
    (r,) = make_requests(VOCAB, CONFIG.max_model_len, [[5]], sampled, [77])
    backend.run([r], max_new_tokens=6)
    assert r.finish_reason is None and len(r.output_ids) == 6
    (fresh,) = make_requests(VOCAB, CONFIG.max_model_len, [[5] + r.output_ids], sampled, [77])
    backend.run([fresh], max_new_tokens=6)
    backend.run([r], max_new_tokens=6)
    assert r.finish_reason == "length" and len(r.output_ids) == 12 and len(r.logprobs) == 12
    assert r.output_ids[6:] != fresh.output_ids  # position 6 of seed 77 is not position 0 of seed 77


def test_start_failures_are_clear(tmp_path, models):
    scratch = set(Path(tempfile.gettempdir()).glob("spectail-vllm-ckpt-*"))
    (tmp_path / "foo").mkdir()
    (tmp_path / "foo" / "config.json").write_text('{"architectures": ["FooForCausalLM"]}')
    with pytest.raises(ValueError, match="unsupported architecture.*FooForCausalLM"):
        VllmBackend(tmp_path / "foo", CONFIG)
    with pytest.raises(ValueError, match="no config.json"):
        VllmBackend(tmp_path / "missing", CONFIG)
    with pytest.raises(ValueError, match="head size is 16.*does not implement"):
        VllmBackend(tiny_hf_model("llama", vocab=VOCAB, hidden_size=32, num_attention_heads=2), CONFIG, EAGER)
    with pytest.raises(ValueError, match="EngineConfig.spec.*must be None for vLLM"):
        VllmBackend(models[0], EngineConfig(spec=SpecConfig()), EAGER)
    models[0].save_pretrained(tmp_path / "llama")
    too_long = EngineConfig(max_batch_size=8, max_model_len=100_000, num_threads=1)  # past max_position_embeddings
    with pytest.raises(RuntimeError, match="vLLM failed to start"):
        VllmBackend(tmp_path / "llama", too_long, EAGER)
    assert set(Path(tempfile.gettempdir()).glob("spectail-vllm-ckpt-*")) == scratch  # nothing left behind


# ---- last: it kills the module's engine ------------------------------------------------------------

def engine_processes() -> list[int]:
    """This process's vLLM engine-core children (by their process title)."""
    pids = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        for child in (task / "children").read_text().split():
            if b"EngineCore" in Path(f"/proc/{child}/cmdline").read_bytes():
                pids.append(int(child))
    return pids


def test_a_dead_engine_fails_the_call_waiting_on_it(backend):
    """The engine process is frozen, then killed (SIGKILL: what the OOM killer sends) while generate
    waits on its outputs. vLLM's own client would wait forever (rollout/vllm_backend/backend.py,
    `failing_fast`): the call raises EngineDeadError instead, and so does every later call, at once."""
    from vllm.v1.engine.exceptions import EngineDeadError

    (engine,) = engine_processes()
    os.kill(engine, signal.SIGSTOP)  # it answers nothing: generate below is waiting when the kill lands
    threading.Timer(1.0, os.kill, (engine, signal.SIGKILL)).start()
    raised = []

    def call():
        try:
            backend.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8), seeds=[0, 1, 2, 3])
        except Exception as e:  # noqa: BLE001 -- checked below
            raised.append(e)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    caller.join(timeout=120)  # (a guard against hanging the suite, not a speed bound)
    assert not caller.is_alive(), "generate still waits on a dead vLLM engine"
    assert len(raised) == 1 and isinstance(raised[0], EngineDeadError), raised
    with pytest.raises(EngineDeadError):
        backend.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8), seeds=[0, 1, 2, 3])
    assert f"(pid {engine}) exit code -9" in engine_exit(backend.llm)
