"""The engine's outputs are a pure function of (weights, prompt, seed, params): speculation,
batch size, batch composition, prefill chunking and divided rollout must not change a token."""
import random

import pytest
import torch

from rollout import Engine, EngineConfig, SamplingParams, SpecConfig
from rollout.proposers.base import Draft, Proposer
from tests.conftest import tiny_hf_model

VOCAB = 101


class OracleProposer(Proposer):
    """Drafts the known reference output, corrupted at a few places: exercises acceptance,
    rejection in the middle of a draft, and bonus tokens."""

    name = "oracle"

    def __init__(self, references, corrupt_every=5):
        self.references, self.corrupt_every = references, corrupt_every

    def propose(self, requests, k):
        return [self._draft(req, k) for req in requests]

    def _draft(self, req, k):
        ref = self.references[tuple(req.prompt_ids)]
        t = len(req.output_ids)
        draft = list(ref[t:t + k])
        for i in range(len(draft)):
            if (t + i) % self.corrupt_every == self.corrupt_every - 1:
                draft[i] = (draft[i] + 1) % VOCAB
        return Draft(draft, self) if draft else None
NGRAM4 = SpecConfig(proposers=("ngram",), max_draft_tokens=4, min_draft_prob=0.0)


def prompts(n=7, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        base = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))]
        out.append(base * rng.randint(1, 3))  # repetition gives the n-gram proposer something
    return out


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("llama", vocab=VOCAB, seed=7)


def engine(hf, **kw):
    kw.setdefault("max_model_len", 96)
    return Engine.from_pretrained(hf, EngineConfig(**kw))


def tokens(outs):
    return [o.token_ids for o in outs]


PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=40),
    SamplingParams(temperature=0.7, max_tokens=40),
    SamplingParams(temperature=1.0, max_tokens=40),
    SamplingParams(temperature=1.0, top_k=5, max_tokens=40),
    SamplingParams(temperature=0.7, top_p=0.8, max_tokens=40),
    SamplingParams(temperature=1.0, top_k=20, top_p=0.9, max_tokens=40, stop_token_ids=[3, 4]),
]


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
def test_speculation_and_batching_do_not_change_tokens(hf, params):
    ps, seeds = prompts(), list(range(100, 107))
    ref = engine(hf, max_batch_size=8).generate(ps, params, seeds=seeds)
    assert any(len(o.token_ids) > 5 for o in ref)
    for bs in (1, 3, 8):
        spec = engine(hf, max_batch_size=bs, spec=NGRAM4)
        assert tokens(spec.generate(ps, params, seeds=seeds)) == tokens(ref), f"ngram, batch {bs}"
    oracle = engine(hf, max_batch_size=3, spec=SpecConfig(max_draft_tokens=6, min_draft_prob=0.0))
    oracle.proposers = [OracleProposer({tuple(p): o.token_ids for p, o in zip(ps, ref)})]
    outs = oracle.generate(ps, params, seeds=seeds)
    assert tokens(outs) == tokens(ref)
    for o, r in zip(outs, ref):
        assert o.finish_reason == r.finish_reason
        assert o.logprobs == pytest.approx(r.logprobs, abs=1e-5)
    accepted = sum(o.stats["accepted"].get("oracle", 0) for o in outs)
    emitted = sum(len(o.token_ids) for o in outs)
    assert accepted > emitted // 2  # the oracle's drafts were mostly taken
    assert sum(o.stats["forward_passes"] for o in outs) < sum(o.stats["forward_passes"] for o in ref)


def test_identical_across_batch_compositions(hf):
    ps, seeds = prompts(9, seed=1), list(range(9))
    params = SamplingParams(temperature=1.0, max_tokens=30)
    full = engine(hf, max_batch_size=4).generate(ps, params, seeds=seeds)
    order = [8, 3, 5, 0, 1, 7, 2, 6, 4]
    shuffled = engine(hf, max_batch_size=5).generate([ps[i] for i in order], params, seeds=[seeds[i] for i in order])
    assert [shuffled[order.index(i)].token_ids for i in range(9)] == tokens(full)
    alone = engine(hf, max_batch_size=1).generate([ps[4]], params, seeds=[seeds[4]])
    assert alone[0].token_ids == full[4].token_ids


def test_one_attention_grid_as_on_a_gpu_is_identical(hf):
    """A GPU engine puts every decode and draft row in one attention grid (launches cost more
    than padding there); the tokens are those of the CPU's grouping by context length."""
    ps, seeds = prompts(8, seed=4), list(range(8))
    params = SamplingParams(temperature=1.0, max_tokens=60)
    cpu = engine(hf, max_batch_size=8, spec=NGRAM4)
    gpu_like = engine(hf, max_batch_size=8, spec=NGRAM4)
    gpu_like.min_bucket = gpu_like.config.max_model_len
    assert cpu.min_bucket == 64
    a, b = cpu.generate(ps, params, seeds=seeds), gpu_like.generate(ps, params, seeds=seeds)
    assert tokens(a) == tokens(b) and any(len(o.token_ids) + len(p) > 64 for o, p in zip(a, ps))
    assert sum((o.logprobs for o in a), []) == pytest.approx(sum((o.logprobs for o in b), []), abs=1e-5)


def test_float64_speculation_is_identical():
    hf = tiny_hf_model("qwen3", vocab=VOCAB, seed=11, dtype=torch.float64)
    ps, seeds = prompts(5, seed=2), [5, 6, 7, 8, 9]
    params = SamplingParams(temperature=1.0, max_tokens=30)
    plain = Engine.from_pretrained(hf, EngineConfig(max_batch_size=5, max_model_len=80, dtype="float64"))
    spec = Engine.from_pretrained(hf, EngineConfig(max_batch_size=2, max_model_len=80, dtype="float64",
                                                   spec=SpecConfig(max_draft_tokens=3, min_draft_prob=0.0)))
    assert tokens(spec.generate(ps, params, seeds=seeds)) == tokens(plain.generate(ps, params, seeds=seeds))


def test_chunked_prefill_and_divided_rollout_are_identical(hf):
    ps, seeds = prompts(6, seed=3), list(range(6))
    params = SamplingParams(temperature=1.0, max_tokens=30)
    ref = engine(hf, max_batch_size=6).generate(ps, params, seeds=seeds)
    chunked = engine(hf, max_batch_size=6, max_num_batched_tokens=4).generate(ps, params, seeds=seeds)
    assert tokens(chunked) == tokens(ref)
    eng = engine(hf, max_batch_size=2, spec=SpecConfig(max_draft_tokens=3, min_draft_prob=0.0))
    reqs = eng.make_requests(ps, params, seeds=seeds)
    rounds = 0
    while any(r.finish_reason is None for r in reqs):
        eng.run(reqs, max_new_tokens=7)
        rounds += 1
    assert rounds > 1
    assert [r.output_ids for r in reqs] == tokens(ref)


def test_a_continued_request_counts_the_forward_of_its_prefill(hf):
    """Every forward that emits counts but the prompt's own: a continued request's prefill (its
    output fed again, elsewhere) emits its next token and accepted drafts as a decode step does."""
    ps, seeds = [p + [1] for p in prompts(4, seed=5)], list(range(4))  # (a one-token prompt has no prefill)
    params = SamplingParams(temperature=1.0, max_tokens=24)
    ref = engine(hf, max_batch_size=4).generate(ps, params, seeds=seeds)
    eng = engine(hf, max_batch_size=4, spec=SpecConfig(proposers=("history",), max_draft_tokens=3, min_draft_prob=0.0))
    reqs = eng.make_requests(ps, params, seeds=seeds, drafts=tokens(ref))
    while any(r.finish_reason is None for r in reqs):
        eng.run(reqs, max_new_tokens=4)  # (no kept slots: each round prefills prompt and output again)
    assert [r.output_ids for r in reqs] == tokens(ref)
    for r in reqs:
        assert r.forward_passes == len(r.output_ids) - 1 - sum(r.accepted.values()) > 0


def test_logprobs_match_transformers_teacher_forced(hf):
    ps, seeds = prompts(4, seed=4), [1, 2, 3, 4]
    for params in (SamplingParams(temperature=0.7, max_tokens=20), SamplingParams(temperature=1.0, max_tokens=20)):
        outs = engine(hf, max_batch_size=4, spec=SpecConfig(max_draft_tokens=3, min_draft_prob=0.0)).generate(
            ps, params, seeds=seeds)
        for p, o in zip(ps, outs):
            with torch.no_grad():
                logits = hf(torch.tensor([p + o.token_ids])).logits[0, len(p) - 1:-1].float()
            ref = torch.log_softmax(logits / params.temperature, -1)
            ref = ref.gather(1, torch.tensor(o.token_ids)[:, None])[:, 0]
            assert (torch.tensor(o.logprobs) - ref).abs().max().item() < 1e-4


def test_stop_tokens_max_tokens_and_max_model_len(hf):
    eng = engine(hf, max_batch_size=4, max_model_len=40)
    greedy = eng.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=30), seeds=[0])[0]
    stop = greedy.token_ids[4]
    cut = eng.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop]), seeds=[0])[0]
    assert cut.finish_reason == "stop" and cut.token_ids == greedy.token_ids[:greedy.token_ids.index(stop) + 1]
    short = eng.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=3), seeds=[0])[0]
    assert short.finish_reason == "length" and short.token_ids == greedy.token_ids[:3]
    long = eng.generate([[5] * 35], SamplingParams(temperature=1.0, max_tokens=30), seeds=[0])[0]
    assert long.finish_reason == "length" and len(long.token_ids) == 5


def test_slots_are_reused_many_more_prompts_than_slots(hf):
    eng = engine(hf, max_batch_size=2, spec=SpecConfig())
    outs = eng.generate(prompts(11, seed=5), SamplingParams(max_tokens=12), seeds=list(range(11)))
    assert len(outs) == 11 and all(len(o.token_ids) >= 1 for o in outs)
    assert [o.seed for o in outs] == list(range(11))


def test_update_weights_changes_outputs_and_matches_fresh_engine(hf):
    other = tiny_hf_model("llama", vocab=VOCAB, seed=8)
    ps, params, seeds = prompts(3, seed=6), SamplingParams(max_tokens=15), [0, 1, 2]
    eng = engine(hf, max_batch_size=3)
    before = tokens(eng.generate(ps, params, seeds=seeds))
    assert eng.update_weights(other.state_dict()) > 0
    after = tokens(eng.generate(ps, params, seeds=seeds))
    assert after == tokens(engine(other, max_batch_size=3).generate(ps, params, seeds=seeds))
    assert after != before
    eng.update_weights(list(hf.named_parameters()))
    assert tokens(eng.generate(ps, params, seeds=seeds)) == before


def test_longest_history_is_admitted_first_and_tokens_do_not_change(hf):
    ps, params, seeds = prompts(5, seed=9), SamplingParams(max_tokens=12), [3, 4, 5, 6, 7]
    histories = [[1] * 4, None, [1] * 30, [2] * 9, None]
    spec = SpecConfig(proposers=("history",))
    eng = engine(hf, max_batch_size=1, spec=spec)
    reqs = eng.make_requests(ps, params, seeds, drafts=histories)
    order = []
    eng.run(reqs, on_finish=lambda r: order.append(r.index))
    # one slot: requests finish in the order they were admitted; unknown lengths go first
    assert order == [1, 4, 2, 3, 0]
    plain = engine(hf, max_batch_size=1).generate(ps, params, seeds=seeds)
    assert [r.output_ids for r in reqs] == tokens(plain)


def test_a_rollout_pauses_the_cyclic_gc_and_restores_it_even_on_error(hf):
    import gc
    eng = engine(hf, max_batch_size=2, spec=SpecConfig(proposers=("ngram",), max_draft_tokens=3))
    seen, step = [], eng._step
    eng._step = lambda running, shares: (seen.append(gc.isenabled()), step(running, shares))[1]
    eng.generate(prompts(3), SamplingParams(max_tokens=5), seeds=[1, 2, 3])
    assert seen and not any(seen)
    assert gc.isenabled()
    eng._step = lambda running, shares: 1 / 0
    with pytest.raises(ZeroDivisionError):
        eng.generate(prompts(1), SamplingParams(max_tokens=5), seeds=[1])
    assert gc.isenabled()
    gc.disable()  # a caller that turned it off keeps it off
    try:
        eng._step = step
        eng.generate(prompts(1), SamplingParams(max_tokens=5), seeds=[1])
        assert not gc.isenabled()
    finally:
        gc.enable()
