"""Batch invariance: a token's logits are the same bits however its forward is shaped.

Speculation on and off can only be token-identical if a verify row computes its logits the
way one-token decodes do, whatever else shares the forward: other requests, their contexts,
slots, query lengths. Each case feeds one sequence under another schedule (decode alone, in a
batch, verify rows, prompt chunks, a re-prefill as after a divided rollout's move, one or two
threads) and demands every position's logits equal, bit for bit, in float32, bfloat16, float64
and float16 (docs/dtypes.md). The model is small but has the wide MLP input (1408) whose
single-row matmul takes another oneDNN kernel, and contexts past several key blocks of attention.
"""
import random

import pytest
import torch
import transformers

from rollout import Engine, EngineConfig, SamplingParams, SpecConfig, attention
from rollout.batch import ForwardBatch
from rollout.model import CausalLM

VOCAB = 1000
PROMPT, CONTINUATION = 150, 14
OTHERS = (30, 600, 7, 60)  # prompt lengths of the other requests sharing some forwards
DTYPES = ("float32", "bfloat16", "float64", "float16")


@pytest.fixture(scope="module")
def hf():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=1408, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def sequences():
    g = torch.Generator().manual_seed(1)
    ours = torch.randint(3, VOCAB, (PROMPT + CONTINUATION,), generator=g).tolist()
    others = [torch.randint(3, VOCAB, (n + CONTINUATION,), generator=g).tolist() for n in OTHERS]
    return ours, others


def run(model, ours, others, chunks, slot=0, with_others=False, threads=None):
    """Feed `ours` in rows of the given lengths (one row per forward), with the other requests
    each advancing one token per forward when with_others. Returns logits of every position."""
    if threads is not None:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return run(model, ours, others, chunks, slot, with_others)
        finally:
            torch.set_num_threads(before)
    cache = model.new_cache(8, 1024)
    other_slots = [s for s in range(8) if s != slot][:len(others)]
    done, pos_others, out = 0, [0] * len(others), []
    for n in chunks:
        rows = [(slot, done, ours[done:done + n])]
        for i, (s, seq) in enumerate(zip(other_slots, others) if with_others else ()):
            take = OTHERS[i] if pos_others[i] == 0 else 1
            rows.append((s, pos_others[i], seq[pos_others[i]:pos_others[i] + take]))
            pos_others[i] += take
        logits, _ = model(ForwardBatch.build(rows, list(range(n)), "cpu"), cache)
        out.append(logits)
        done += n
    return torch.cat(out)


def decode(prompt_chunks):
    return list(prompt_chunks) + [1] * (PROMPT + CONTINUATION - sum(prompt_chunks))


SCHEDULES = {
    "other slot": dict(chunks=decode([PROMPT]), slot=5),
    "in a batch": dict(chunks=decode([PROMPT]), with_others=True),
    "verify 4 rows": dict(chunks=[PROMPT, 1, 4, 4, 1, 4]),
    "verify 4 rows in a batch": dict(chunks=[PROMPT, 1, 4, 4, 1, 4], with_others=True),
    "verify 9 rows": dict(chunks=[PROMPT, 9, 5]),
    "prompt in chunks": dict(chunks=decode([17, 23, PROMPT - 40])),
    "prompt in short chunks": dict(chunks=decode([5] * (PROMPT // 5))),
    "re-prefill after 6 tokens": dict(chunks=decode([PROMPT + 6])),
    "one thread, in a batch": dict(chunks=decode([PROMPT]), with_others=True, threads=1),
    "two threads, verify rows": dict(chunks=[PROMPT, 1, 4, 4, 1, 4], with_others=True, threads=2),
}


@pytest.mark.parametrize("dtype", DTYPES)
def test_logits_do_not_depend_on_the_shape_of_the_forward(hf, sequences, dtype):
    model = CausalLM.from_pretrained(hf, getattr(torch, dtype))
    ours, others = sequences
    ref = run(model, ours, others, decode([PROMPT]))
    differing = {}
    for name, schedule in SCHEDULES.items():
        rows = (run(model, ours, others, **schedule) != ref).any(-1)
        if rows.any():
            differing[name] = rows.nonzero().flatten().tolist()
    assert not differing, f"{dtype}: positions whose logits changed, by schedule: {differing}"


def corrupted(tokens, every=5):
    return [(t + 1) % VOCAB if i % every == every - 1 else t for i, t in enumerate(tokens)]


@pytest.mark.parametrize("dtype", ("float32", "bfloat16", "float16"))
def test_speculation_is_bit_identical(hf, dtype):
    """Drafts from the reference itself (every 5th token wrong): every token is verified in
    rows of several, in other batches; tokens and logprobs must be the same bits."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 40))] for _ in range(12)]
    params = SamplingParams(temperature=1.0, max_tokens=30)
    seeds = list(range(12))
    plain = Engine.from_pretrained(hf, EngineConfig(max_batch_size=8, max_model_len=128, dtype=dtype))
    ref = plain.generate(prompts, params, seeds=seeds)
    spec = Engine.from_pretrained(hf, EngineConfig(max_batch_size=5, max_model_len=128, dtype=dtype, spec=SpecConfig(
        proposers=("history",), max_draft_tokens=6, min_draft_prob=0.0)))
    outs = spec.generate(prompts, params, seeds=seeds, drafts=[corrupted(o.token_ids) for o in ref])
    assert sum(o.stats["accepted"].get("history", 0) for o in outs) > sum(len(o.token_ids) for o in ref) // 2
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert [o.logprobs for o in outs] == [o.logprobs for o in ref]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_query_attends_with_the_same_bits_in_any_grid(dtype):
    """The attention kernel alone, at positions where a single matmul over all keys would change
    its reduction with the grid's width (float32 past 3 key blocks, bfloat16 past 1024 keys):
    one verify row's queries in a grid as wide as their context, against the same queries in
    wider grids, among more rows and more queries."""
    dt, kv, share, d = getattr(torch, dtype), 2, 2, 64
    g = torch.Generator().manual_seed(5)
    keys, values = (torch.randn(3, kv, 1600, d, generator=g).to(dt) for _ in range(2))
    ours = torch.randn(kv, share * 2, d, generator=g).to(dt)  # two query positions, two heads per KV head

    def grid(pos, rows, queries, width):
        """Our queries first in row 0's folded axis, then others; padded as plan() pads."""
        chunks = attention._chunks(share * queries, dt)
        padded = chunks[-1][0] + chunks[-1][1]
        q = torch.zeros(rows, kv, padded, d, dtype=dt)
        q[:, :, :share * queries] = torch.randn(rows, kv, share * queries, d, generator=g).to(dt)
        q[0, :, :share * 2] = ours
        mask = torch.full((rows, 1, padded, width), float("-inf"))
        mask[..., :pos + 1] = 0.0
        out = attention._attend_matmul(q, keys[:rows, :, :width], values[:rows, :, :width], mask, tuple(chunks))
        return out[0, :, :share * 2]

    for pos in (191, 1023, 1100):
        width = -(-(pos + 1) // attention.KEY_BLOCK) * attention.KEY_BLOCK
        ref = grid(pos, 1, 2, width)
        for rows, queries, wider in ((1, 2, width + 64), (3, 2, 1600), (3, 4, 1152), (2, 9, 1536)):
            assert torch.equal(grid(pos, rows, queries, max(wider, width)), ref), (pos, rows, queries, wider)
