"""The CPU attention kernel: right against a float64 reference, and a token's output the same bits
in any batch (alone, with others, in another order, at another thread split).

The engine-level guarantees that rest on it (speculation on and off, batch sizes and divided
rollouts give the same bits in bfloat16 and float32) are tests/rollout/test_bf16_identity.py's;
the last test here checks that those engines do run the kernel, and that the torch attention it
replaces (still the path of other devices) gives the same tokens.
"""
from __future__ import annotations

import pytest
import torch

from rollout import Engine, EngineConfig, SamplingParams
from rollout.kernels import attention_kernel
from tests.conftest import tiny_hf_model


def kernel_or_skip():
    if attention_kernel.load() is None:
        pytest.skip("the CPU attention kernel could not be built here (no C compiler?)")


def case(dtype, heads=8, kv_heads=4, head_dim=64, slots=12, max_len=96, tokens=20, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(slots, kv_heads, max_len, head_dim, generator=gen).to(dtype)
    v = torch.randn(slots, kv_heads, max_len, head_dim, generator=gen).to(dtype)
    q = (torch.randn(tokens, heads, head_dim, generator=gen) * 2).to(dtype)
    token_slots = torch.randint(0, slots, (tokens,), generator=gen)
    positions = torch.randint(0, max_len, (tokens,), generator=gen)
    return q, k, v, token_slots, positions


def attend(q, k, v, slots, positions, window):
    """The kernel on caches laid out [slot, head, position, dim]: keys handed over transposed."""
    return attention_kernel.attend(q, k.transpose(2, 3).contiguous(), v, slots, positions, window)


def reference(q, k, v, slots, positions, window):
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    for i in range(q.shape[0]):
        p = int(positions[i])
        lo = max(0, p - window + 1) if window else 0
        keys = k[slots[i], :, lo:p + 1].double().repeat_interleave(group, 0)
        values = v[slots[i], :, lo:p + 1].double().repeat_interleave(group, 0)
        scores = torch.einsum("hd,hjd->hj", q[i].double(), keys) / q.shape[2] ** 0.5
        out[i] = torch.einsum("hj,hjd->hd", scores.softmax(-1), values)
    return out


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [dict(), dict(heads=4, kv_heads=4, head_dim=16), dict(heads=6, kv_heads=2,
                                                                                          head_dim=24),
                                   dict(heads=2, kv_heads=1, head_dim=12)])
@pytest.mark.parametrize("window", [None, 7])
def test_the_kernel_is_attention(dtype, tolerance, shape, window):
    kernel_or_skip()
    q, k, v, slots, positions = case(dtype, **shape)
    got = attend(q, k, v, slots, positions, window)
    assert got.dtype == dtype and got.shape == q.shape
    assert (got.double() - reference(q, k, v, slots, positions, window)).abs().max() < tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_token_has_the_same_bits_in_any_batch(dtype, monkeypatch):
    kernel_or_skip()
    q, k, v, slots, positions = case(dtype, tokens=40, seed=1)
    full = attend(q, k, v, slots, positions, None)
    for index in ([5], [3, 17, 2], list(range(39, -1, -1)), [0, 0, 7, 7, 7]):
        index = torch.tensor(index)
        assert torch.equal(attend(q[index], k, v, slots[index], positions[index], None), full[index])
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)  # four row ranges on four threads
    assert torch.equal(attend(q, k, v, slots, positions, None), full)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [dict(), dict(heads=6, kv_heads=2, head_dim=24), dict(heads=16, kv_heads=1)])
def test_a_requests_consecutive_tokens_read_the_cache_together_with_the_same_bits(dtype, tolerance, shape):
    """Verify rows and prompt chunks (a slot's tokens at consecutive positions) go through the
    kernel's shared-load path: right, and each token the same bits as alone; with a window that
    cuts into them, each token alone."""
    kernel_or_skip()
    q, k, v, _, _ = case(dtype, tokens=43, seed=3, **shape)
    runs = [(4, 0, 9), (7, 30, 17), (1, 60, 2), (4, 85, 11), (9, 5, 1), (2, 0, 3)]  # (slot, first position, tokens)
    slots = torch.tensor([s for s, _, n in runs for _ in range(n)])
    positions = torch.tensor([p + i for _, p, n in runs for i in range(n)])
    for window in (None, 12):
        got = attend(q, k, v, slots, positions, window)
        assert (got.double() - reference(q, k, v, slots, positions, window)).abs().max() < tolerance
        for i in range(len(slots)):
            assert torch.equal(attend(q[i:i + 1], k, v, slots[i:i + 1], positions[i:i + 1], window), got[i:i + 1])


def test_keys_past_a_token_do_not_reach_it():
    kernel_or_skip()
    q, k, v, slots, positions = case(torch.float32, tokens=10, seed=2)
    before = attend(q, k, v, slots, positions, None)
    k2, v2 = k.clone(), v.clone()
    for s, p in zip(slots.tolist(), positions.tolist()):
        k2[s, :, p + 1:], v2[s, :, p + 1:] = float("nan"), float("nan")  # stale entries past a rollback
    # (a slot shared by two tokens keeps the later one's keys: those tokens are checked apart)
    alone = [i for i in range(10) if slots.tolist().count(int(slots[i])) == 1]
    after = attend(q, k2, v2, slots, positions, None)
    assert alone and torch.equal(after[alone], before[alone])


def test_engines_run_the_kernel_and_torch_attention_gives_the_same_tokens(monkeypatch):
    kernel_or_skip()
    hf = tiny_hf_model("llama", vocab=101, seed=4)
    calls = []
    real = attention_kernel.attend
    monkeypatch.setattr(attention_kernel, "attend", lambda *a: calls.append(1) or real(*a))
    prompts = [[3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14]]
    params = SamplingParams(temperature=1.0, max_tokens=30)

    def run():
        engine = Engine.from_pretrained(hf, EngineConfig(max_batch_size=4, max_model_len=64, num_threads=1))
        return [o.token_ids for o in engine.generate(prompts, params, seeds=[1, 2, 3])]

    with_kernel = run()
    assert calls  # the tests' models run through the kernel
    monkeypatch.setattr(attention_kernel, "supports", lambda *a: False)
    calls.clear()
    assert run() == with_kernel and not calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["keys", "values"])
def test_keys_and_values_land_where_torch_puts_them(dtype, kind):
    """Keys into the transposed cache [slots, Hkv, D, max_len], values into [slots, Hkv, max_len, D]."""
    kernel_or_skip()
    gen = torch.Generator().manual_seed(3)
    shape = (6, 2, 24, 40) if kind == "keys" else (6, 2, 40, 24)
    cache = torch.randn(*shape, generator=gen).to(dtype)
    slots, positions = torch.tensor([4, 0, 4, 5]), torch.tensor([7, 39, 8, 0])
    new = torch.randn(4, 2, 24, generator=gen).to(dtype)
    expected = cache.clone()
    if kind == "keys":
        expected[slots, :, :, positions] = new
        attention_kernel.write_keys(cache, slots, positions, new)
    else:
        expected[slots, :, positions] = new
        attention_kernel.write_values(cache, slots, positions, new)
    assert torch.equal(cache, expected)
