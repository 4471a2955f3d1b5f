"""The drafter inside the engine: outputs never change, the engine hands the head the right rows
(an oracle head is accepted everywhere), the engine's drafts are exactly the simulation's, the
buffer holds the policy's own features, and a bad head switches the drafter off."""
import random

import pytest
import torch

from drafter.draft import ChainDraft
from drafter.export import export, head_state
from drafter.features import SavedRollout, sequence_features
from drafter.head import DraftHead, HeadConfig
from drafter.head_cache import Rows
from drafter.proposer import DrafterProposer
from drafter.simulate import chain_runs
from drafter.warm_start import warm_start
from rollout import Engine, EngineConfig, SamplingParams, SpecConfig
from rollout.config import DrafterSpec
from rollout.proposers.base import StepResult, Verified
from tests.drafter.conftest import VOCAB, sharp_policy

PARAMS = [SamplingParams(temperature=1.0, max_tokens=30, stop_token_ids=[0]),
          SamplingParams(temperature=0.7, top_k=9, top_p=0.9, max_tokens=25),
          SamplingParams(temperature=0.0, max_tokens=20)]


def workload(n=12, seed=0):
    rng = random.Random(seed)
    prompts = [[1] + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 7))] for _ in range(n)]
    return prompts, [PARAMS[i % len(PARAMS)] for i in range(n)], [seed * 100 + i for i in range(n)]


def engine(policy, proposers=("drafter",), batch=5, head=None, spec_kw=None, **drafter_kw):
    spec = SpecConfig(proposers=proposers, max_draft_tokens=5, min_draft_prob=0.0,
                      drafter=DrafterSpec(**drafter_kw), **(spec_kw or {}))
    eng = Engine(policy, EngineConfig(max_batch_size=batch, max_model_len=96, dtype=str(policy.lm_head.weight.dtype)
                                      .removeprefix("torch."), spec=spec))
    if head is not None:
        DrafterProposer.of(eng).set_head(head, 1)
    return eng


@pytest.fixture(scope="module")
def policy64():
    return sharp_policy(dtype=torch.float64)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_outputs_are_identical_with_the_drafter_on_and_off(dtype, policy, policy64):
    pol = policy if dtype == "float32" else policy64
    prompts, params, seeds = workload()
    ref = Engine(pol, EngineConfig(max_batch_size=5, max_model_len=96, dtype=dtype)).generate(prompts, params, seeds)
    head = DraftHead.for_policy(pol, HeadConfig(), seed=7)
    for proposers in (("drafter",), ("suffix", "lookahead", "drafter")):
        eng = engine(pol, proposers, head=head)
        groups = [i // 3 for i in range(len(prompts))]
        out = eng.generate(prompts, params, seeds, groups=groups)
        assert [o.token_ids for o in out] == [o.token_ids for o in ref]
        assert [x for o in out for x in o.logprobs] == pytest.approx([x for o in ref for x in o.logprobs], abs=1e-5)
        proposed = sum(o.stats["proposed"].get("drafter", 0) for o in out)
        accepted = sum(o.stats["accepted"].get("drafter", 0) for o in out)
        # a random head: some land, some do not (beside the copies it drafts only where it is
        # expected to beat them, which a random head seldom is)
        assert proposed > (50 if len(proposers) == 1 else 20) and 0 < accepted < proposed
    # in chunks (paused requests leave and come back, their rows re-fed): the same tokens
    eng = engine(pol, head=head)
    reqs = eng.make_requests(prompts, params, seeds)
    while any(r.finish_reason is None for r in reqs):
        eng.run(reqs, max_new_tokens=4)
    assert [r.output_ids for r in reqs] == [o.token_ids for o in ref]
    assert eng.state_sizes() == {"drafter.requests": 0}  # every request's state left with it


class EngineOracle(DraftHead):
    """Outputs the policy's own h_{j+1} at row j: it remembers the token each row carried per slot
    (row j holds x_{j+1}; x_0 is every prompt's first token, 1) and runs the policy over them."""

    def forward_rows(self, policy, cache, rows: Rows, packed=None):
        seqs = self.__dict__.setdefault("seqs", {})
        last = list(range(len(rows.slots))) if rows.all_last else rows.last.tolist()
        row_slots = [s for s, a, b in zip(rows.slots, [-1] + last, last) for _ in range(b - a)]
        for tok, slot, pos in zip(rows.tokens.tolist(), row_slots, rows.positions.tolist()):
            seqs.setdefault(slot, {})[pos + 1] = tok
        outs = []
        for slot, pos in zip(rows.slots, rows.last_positions.tolist()):
            seq = [1] + [seqs[slot][p] for p in range(1, pos + 2)]
            outs.append(sequence_features(policy, [seq])[0][-1])
        out = torch.stack(outs).to(self.fc.weight.dtype)
        return out, self.logits(policy, out)


def test_an_oracle_head_is_accepted_everywhere(policy64):
    """The alignment in the engine: features of the right rows, the pending token, the seed and
    response position of each draft token. Off by one anywhere, and it is rejected."""
    oracle = EngineOracle(HeadConfig().resolved(policy64.cfg), policy64.cfg.hidden_size, VOCAB).double()
    prompts, params, seeds = workload(8, seed=3)
    eng = engine(policy64, head=oracle, batch=4)
    dp, moved = DrafterProposer.of(eng), []
    move = dp._move

    def follow(src, dst):  # the oracle's rows are kept per slot too: they move along
        seqs = oracle.__dict__.setdefault("seqs", {})
        rows = [seqs.pop(s, {}) for s in src]
        seqs.update(zip(dst, rows))
        moved.append(len(src))
        move(src, dst)

    dp._move = follow
    out = eng.generate(prompts, params, seeds)
    assert moved  # requests changed slots mid-run
    proposed = sum(o.stats["proposed"]["drafter"] for o in out)
    assert proposed > 60 and sum(o.stats["accepted"]["drafter"] for o in out) == proposed


@pytest.mark.parametrize("window", [None, 3])
def test_engine_drafts_are_exactly_the_simulated_ones(policy64, rollouts, window):
    """For a fixed head the engine accepts, at every draft, min(run, k) where run is the
    simulated accepted run of a chain starting at the same position (drafter/simulate.py).
    With a window, a request's rows older than the window are never written (nor read)."""
    rolls, _ = rollouts
    head, _, _ = warm_start(policy64, rolls, HeadConfig(window=window), max_steps=25, time_budget_s=60.0)
    check_drafts_against_simulation(policy64, head, *workload(10, seed=5))


def test_a_request_that_shares_its_prompt_drafts_from_its_donors_features(policy64, rollouts):
    """A GRPO group's samples compute their prompt once (rollout/core/prompt_share.py): the
    others take the donor's features of it, and their drafts are still exactly the simulation's."""
    rolls, _ = rollouts
    head, _, _ = warm_start(policy64, rolls, HeadConfig(), max_steps=25, time_budget_s=60.0)
    prompts, params, seeds = workload(4, seed=6)
    n = 3
    adopted = check_drafts_against_simulation(policy64, head, [p for p in prompts for _ in range(n)],
                                              [q for q in params for _ in range(n)], list(range(len(prompts) * n)))
    assert adopted > 10  # drafts of requests that took their prompt from a donor


def check_drafts_against_simulation(policy64, head, prompts, params, seeds) -> int:
    """Runs the engine with the head; returns how many drafts went to requests that took their
    prompt from a donor."""
    eng = engine(policy64, head=head, batch=4)
    dp = DrafterProposer.of(eng)
    seen, on_step, shared = [], dp.on_step, []

    def record(result):
        shared.extend(result.shared)
        for req, draft, accepted, emitted, _, _ in result.rows:
            if draft is not None and draft.proposer is dp:
                seen.append((req.index, len(req.output_ids) - len(emitted) - 1, len(draft.tokens), accepted))
        return on_step(result)

    dp.on_step = record
    out = eng.generate(prompts, params, seeds)
    saved = [SavedRollout(p, o.token_ids, s, q.temperature, q.top_k, q.top_p)
             for p, o, s, q in zip(prompts, out, seeds, params)]
    runs = chain_runs(head, policy64, saved, max_k=5)
    assert len(seen) > 40 and sum(a for *_, a in seen) > 40
    assert [(i, t, k, min(runs[i][t][0], k)) for i, t, k, _ in seen] == seen
    takers = {req.index for req, _, _ in shared}
    return sum(i in takers for i, *_ in seen)


def test_the_buffer_holds_each_responses_own_features(policy):
    prompts, params, seeds = workload(6, seed=2)
    eng = engine(policy, head=DraftHead.for_policy(policy, HeadConfig(), seed=1), batch=3)
    reqs = eng.make_requests(prompts, params, seeds)
    eng.run(reqs, max_new_tokens=5)  # paused: in the buffer as unfinished entries, keyed by seed
    buf = DrafterProposer.of(eng).buffer
    assert len(buf) == 6 and not any(e.finished for e in buf)
    while any(r.finish_reason is None for r in reqs):
        eng.run(reqs)
    assert len(buf) == 6 and all(e.finished for e in buf)
    for r in reqs:
        e = buf.get(r.seed)
        assert e.sample.token_ids == r.prompt_ids + r.output_ids
        want = sequence_features(policy, [e.sample.token_ids])[0]
        torch.testing.assert_close(e.features[:-1], want[:-1], atol=1e-5, rtol=1e-5)


def test_a_bad_head_is_refused_and_the_engine_keeps_working(policy, tmp_path):
    prompts, params, seeds = workload(6, seed=4)
    ref = Engine(policy, EngineConfig(max_batch_size=3, max_model_len=96)).generate(prompts, params, seeds)
    good = DraftHead.for_policy(policy, HeadConfig(), seed=1)
    eng = engine(policy, ("suffix", "drafter"), batch=3, head=good)
    dp = DrafterProposer.of(eng)
    other = DraftHead.for_policy(sharp_policy(vocab=VOCAB + 5), HeadConfig(), seed=1)
    with pytest.raises(ValueError, match="vocabulary"):
        dp.set_head(other, 2)
    nan = DraftHead.for_policy(policy, HeadConfig(), seed=1)
    with torch.no_grad():
        nan.fc.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        dp.set_head(nan, 2)
    assert dp.head is good and dp.head_version == 1
    with pytest.warns(UserWarning, match="switched off"):
        assert not dp.load(head_state(nan), 3)  # a published version that does not load
    assert dp.head is None
    assert [o.token_ids for o in eng.generate(prompts, params, seeds)] == [o.token_ids for o in ref]
    export(other, tmp_path / "other")
    with pytest.warns(UserWarning, match="switched off"):
        eng2 = engine(policy, ("suffix", "drafter"), batch=3, path=str(tmp_path / "other"))
    out = eng2.generate(prompts, params, seeds, groups=[0] * 6)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert sum(o.stats["proposed"].get("suffix", 0) for o in out) > 0  # the others keep drafting


def test_no_head_and_no_collecting_costs_nothing(policy):
    eng = engine(policy, ("suffix", "drafter"), collect=False)
    dp = DrafterProposer.of(eng)
    assert not dp.wants_hidden
    prompts, params, seeds = workload(4)
    eng.generate(prompts, params, seeds)
    assert dp.store is None and dp.stats["steps"] == 0


def test_a_head_from_an_export_folder_drafts(policy, tmp_path):
    head = DraftHead.for_policy(policy, HeadConfig(kind="mlp"), seed=3)
    export(head, tmp_path / "h")
    eng = engine(policy, path=str(tmp_path / "h"))
    assert DrafterProposer.of(eng).head.kind == "mlp"
    prompts, params, seeds = workload(4)
    assert sum(o.stats["proposed"].get("drafter", 0) for o in eng.generate(prompts, params, seeds)) > 0


def test_propose_drafts_with_its_run_as_evidence_and_forgets_a_request_that_leaves(policy, monkeypatch):
    eng = engine(policy, head=DraftHead.for_policy(policy, HeadConfig(), seed=3))
    dp = DrafterProposer.of(eng)
    (req,) = eng.make_requests([[1, 5, 6]], SamplingParams(max_tokens=9))
    req.output_ids, req.slot = [7], 0
    assert dp.propose([req], 3) == [None]  # no features kept for it: nothing to draft from
    hidden = torch.zeros(3, policy.cfg.hidden_size, dtype=policy.lm_head.weight.dtype)
    dp.on_step(StepResult(hidden=hidden, spans=[(req, 0, 0, 3)]))  # positions 0 .. 2: the pending token's context
    req.proposer_state["drafter"].run = 6
    monkeypatch.setattr("drafter.proposer.draft_chains", lambda head, model, cache, chains, margins: [
        ChainDraft([4, 5, 6, 7][:c.k], [0.0, 1.0, 3.0, 9.0][:c.k]) for c in chains])
    (d,) = dp.propose([req], 3)
    assert d.tokens == [4, 5, 6] and d.evidence == 6 and d.confidence == pytest.approx(
        [0.0, 1 - 2.718281828 ** -1, 1 - 2.718281828 ** -3], rel=1e-6)
    dp.on_step(StepResult(rows=[Verified(req, d, 2, [4, 5], [4, 5, 6, 1], [0.0] * 4)]))
    assert req.proposer_state["drafter"].run == 8  # the request ended inside the draft: nothing rejected
    dp.on_step(StepResult(rows=[Verified(req, d, 1, [4, 9], [4, 9, 1, 1], [0.0] * 4)]))
    assert req.proposer_state["drafter"].run == 0  # rejected: the run starts over
    assert dp.state_sizes() == {"requests": 1}
    dp.on_step(StepResult(left=[req]))
    assert "drafter" not in req.proposer_state and dp.state_sizes() == {"requests": 0}
