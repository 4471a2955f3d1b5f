"""bfloat16 on the CPU: the same tokens and the same logprob bits with speculation on and off, at
other batch sizes and with divided rollouts. A verify row computes a position in a forward of
another shape than the decode that computes it with speculation off; the logits must not depend
on that shape (batch.KEY_STEP, linear.PackedLinear; docs/dtypes.md). Equal logprobs catch any change in
a logit row's bits, not only those that happen to flip a token."""
import random

import pytest
import torch

from rollout import Engine, EngineConfig, SamplingParams, SpecConfig
from rollout.kernels import attention_kernel
from rollout.kernels.linear import PackedLinear
from tests.conftest import tiny_hf_model
from tests.rollout.test_engine import OracleProposer

VOCAB = 101


def prompts(n, seed):
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(2, 9))] * rng.randint(1, 3) for _ in range(n)]


# head_dim 64 and 2 or 8 heads: torch's CPU attention picks its kernels by head size and count;
# larger weights than the default init give logits of a trained model's scale
SHAPES = {"2 heads": dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1),
          "8 heads": dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=4)}


@pytest.fixture(scope="module", params=list(SHAPES))
def hf(request):
    return tiny_hf_model("llama", vocab=VOCAB, seed=3, intermediate_size=256, initializer_range=0.1,
                         **SHAPES[request.param])


def engine(hf, batch, dtype="bfloat16", spec=None, **kw):
    return Engine.from_pretrained(hf, EngineConfig(max_batch_size=batch, max_model_len=160, dtype=dtype,
                                                   num_threads=1, spec=spec, **kw))


def same(outs, ref):
    return [(o.token_ids, o.logprobs) for o in outs] == [(r.token_ids, r.logprobs) for r in ref]


@pytest.fixture(params=["kernel", "torch"])
def attention(request, monkeypatch):
    """Both attention paths of the CPU: the C kernel (rollout/kernels/attention_kernel.py) and torch's on
    invariant grids (other devices, or no C compiler)."""
    if request.param == "kernel" and attention_kernel.load() is None:
        pytest.skip("the CPU attention kernel could not be built here (no C compiler?)")
    if request.param == "torch":
        monkeypatch.setattr(attention_kernel, "supports", lambda *a: False)
    return request.param


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_speculation_and_batch_size_give_the_same_bits(hf, dtype, attention):
    ps, seeds = prompts(10, seed=1), list(range(10))
    params = SamplingParams(temperature=1.0, max_tokens=64)
    ref = engine(hf, 8, dtype).generate(ps, params, seeds=seeds)
    runs = {"plain, batch 3": engine(hf, 3, dtype),
            "ngram, batch 8": engine(hf, 8, dtype, SpecConfig(proposers=("ngram",), max_draft_tokens=4,
                                                               min_draft_prob=0.0))}
    oracle = engine(hf, 5, dtype, SpecConfig(max_draft_tokens=6, min_draft_prob=0.0))
    oracle.proposers = [OracleProposer({tuple(p): o.token_ids for p, o in zip(ps, ref)})]
    runs["oracle drafts, every 5th wrong, batch 5"] = oracle
    for name, eng in runs.items():
        outs = eng.generate(ps, params, seeds=seeds)
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref], name
        if dtype == "bfloat16":  # float32 MKL matmuls (small weights) are not row-invariant in the last bits
            assert same(outs, ref), name
    assert sum(o.stats["accepted"].get("oracle", 0) for o in outs) > sum(len(r.token_ids) for r in ref) // 2


def test_divided_rollout_and_chunked_prefill_give_the_same_bits(hf, attention):
    """A divided rollout re-prefills prompt and output in one row: positions first computed by
    decodes are recomputed in a prompt-sized grid."""
    ps, seeds = prompts(6, seed=2), list(range(6))
    params = SamplingParams(temperature=1.0, max_tokens=60)
    ref = engine(hf, 6).generate(ps, params, seeds=seeds)
    assert same(engine(hf, 6, max_num_batched_tokens=5).generate(ps, params, seeds=seeds), ref)
    eng = engine(hf, 2, spec=SpecConfig(max_draft_tokens=3, min_draft_prob=0.0))
    reqs = eng.make_requests(ps, params, seeds=seeds)
    while any(r.finish_reason is None for r in reqs):
        eng.run(reqs, max_new_tokens=9)
    assert [(r.output_ids, r.logprobs) for r in reqs] == [(o.token_ids, o.logprobs) for o in ref]


def test_a_one_row_bf16_linear_call_rounds_like_a_row_of_a_batch():
    torch.manual_seed(0)
    layer = PackedLinear(4864, 896, bias=False).to(torch.bfloat16)
    x = torch.randn(5, 4864).to(torch.bfloat16)
    with torch.inference_mode():  # the engine's (packed) path
        batched = layer(x)
        assert all(torch.equal(layer(x[i:i + 1])[0], batched[i]) for i in range(5))
    batched = layer(x)
    for i in range(5):
        assert torch.equal(layer(x[i:i + 1])[0], batched[i])


def test_a_position_gets_the_same_logits_in_any_grid():
    """Forward level, at every position of a long context: a decode alone, beside a row that
    reaches further (so the grid reads more keys), and as the last token of a verify row."""
    from rollout.core.batch import ForwardBatch
    from rollout.core.model import CausalLM

    hf = tiny_hf_model("llama", vocab=VOCAB, seed=5, intermediate_size=256, initializer_range=0.1,
                       **SHAPES["8 heads"])
    model = CausalLM.from_pretrained(hf, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    seq = [torch.randint(0, VOCAB, (512,), generator=g).tolist() for _ in range(2)]
    cache = model.new_cache(2, 512)
    model(ForwardBatch.build([(0, 0, seq[0]), (1, 0, seq[1])], [0], "cpu"), cache)
    saved = [t.clone() for t in cache.k + cache.v]

    def logits(rows, index):
        out = model(ForwardBatch.build(rows, [index], "cpu"), cache)[0][0]
        for t, s in zip(cache.k + cache.v, saved):
            t.copy_(s)
        return out

    for p in range(300, 400):
        alone = logits([(0, p, [seq[0][p]])], 0)
        beside = logits([(0, p, [seq[0][p]]), (1, 511, [seq[1][511]])], 0)
        verify = logits([(0, p - 3, seq[0][p - 3:p + 1])], 3)
        assert torch.equal(alone, beside) and torch.equal(alone, verify), p
