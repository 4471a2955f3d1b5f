"""Speculation on and off on the real model: the same tokens at T = 1 (float32) with every
proposer, each one actually drafting (min_draft_prob 0: it drafts whenever it has a draft), the
drafter with a freshly initialised head, whose collected features are then refreshed on the
real model (the crash of issue 47); bfloat16 labelled as it behaves (docs/dtypes.md)."""
from __future__ import annotations

import pytest
import torch

from rollout import Engine, EngineConfig, SamplingParams
from rollout.config import DrafterSpec, SpecConfig
from tests.real.conftest import EOS

SAMPLES = 2  # a GRPO group of two per prompt: the suffix proposer drafts from the sibling
PARAMS = SamplingParams(temperature=1.0, max_tokens=24, stop_token_ids=[EOS])


def workload(prompts):
    ids = [p for p in prompts for _ in range(SAMPLES)]
    return ids, [7000 + i for i in range(len(ids))], [i // SAMPLES for i in range(len(ids))]


def run(policy, dtype, spec=None, head=None, drafts=None, seeds=None, prompts=None):
    eng = Engine(policy, EngineConfig(max_batch_size=8, max_model_len=256, dtype=dtype, spec=spec))
    if head is not None:
        from drafter.proposer import DrafterProposer

        DrafterProposer.of(eng).set_head(head, 1)
    ids, default_seeds, groups = workload(prompts)
    return eng, eng.generate(ids, PARAMS, seeds=seeds or default_seeds, drafts=drafts, groups=groups)


def spec(*proposers, **drafter):
    return SpecConfig(proposers=proposers, max_draft_tokens=4, min_draft_prob=0.0, drafter=DrafterSpec(**drafter))


@pytest.fixture(scope="module")
def plain(policy, chat_prompts):
    return run(policy, "float32", prompts=chat_prompts)[1]


@pytest.fixture(scope="module")
def history_drafts(plain):
    """Last step's responses: this step's own for half the samples (all accepted: long verified
    runs), for the others the same with every fifth token changed (rejections mid-draft)."""
    def spoil(ids):
        return [(t + 1) % 49152 if j % 5 == 4 else t for j, t in enumerate(ids)]

    return [o.token_ids if i % 2 else spoil(o.token_ids) for i, o in enumerate(plain)]


def assert_same(outs, ref, proposer):
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    got = torch.tensor([x for o in outs for x in o.logprobs])
    assert float((got - torch.tensor([x for o in ref for x in o.logprobs])).abs().max()) < 1e-4
    assert sum(o.stats["proposed"].get(proposer, 0) for o in outs) > 0  # it did draft


# lookahead drafts only after a verify step that rejected: it runs behind the n-gram proposer
@pytest.mark.parametrize("proposers", [("history",), ("suffix",), ("ngram", "lookahead"), ("ngram",)],
                         ids=["history", "suffix", "lookahead", "ngram"])
def test_speculation_on_and_off_token_identical_float32(proposers, policy, chat_prompts, plain, history_drafts):
    drafts = history_drafts if proposers == ("history",) else None
    outs = run(policy, "float32", spec(*proposers), drafts=drafts, prompts=chat_prompts)[1]
    assert_same(outs, plain, proposers[-1])


def test_drafter_with_a_fresh_head_token_identical_and_its_buffer_refreshes_float32(policy, chat_prompts, plain):
    from drafter.features import sequence_features
    from drafter.head import DraftHead, HeadConfig
    from drafter.proposer import DrafterProposer

    head = DraftHead.for_policy(policy, HeadConfig(), seed=0)
    eng, outs = run(policy, "float32", spec("drafter", collect=True), head=head, prompts=chat_prompts)
    assert_same(outs, plain, "drafter")
    # what `spectail train` does between steps: recompute the collected features under the new
    # version's weights (sequence_features asks no logits: lm_head runs on no rows)
    buf = DrafterProposer.of(eng).buffer
    assert len(buf) == len(outs)
    version = max(buf.versions()) + 1
    assert buf.refresh(policy, version) == buf.total_tokens
    entries = list(buf)
    fresh = sequence_features(policy, [e.sample.token_ids for e in entries])
    for e, f in zip(entries, fresh):
        assert e.version == version and torch.equal(e.features, f.to(e.features.dtype))


def test_bfloat16_speculation_on_and_off_bit_identical(policy_bf16, chat_prompts):
    """bfloat16 on the CPU: the same bits with speculation on and off, tokens AND logprobs
    (docs/dtypes.md's table), here with siblings and the prompt lookup drafting."""
    ref = run(policy_bf16, "bfloat16", prompts=chat_prompts)[1]
    outs = run(policy_bf16, "bfloat16", spec("suffix", "lookahead", "ngram"), prompts=chat_prompts)[1]
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert [o.logprobs for o in outs] == [o.logprobs for o in ref]
    assert sum(sum(o.stats["proposed"].values()) for o in outs) > 0
