"""HistoryProposer: drafts from last epoch's response, re-aligning after edits."""
import random

import pytest

from rollout.config import SamplingParams
from rollout.core import lenient
from rollout.core.request import Request
from rollout.proposers.base import Proposer
from rollout.proposers.history import HistoryProposer
from tests.rollout.proposer_sim import drafted, finish, observe, propose, run


def make_req(history, index=0, prompt=(1, 2, 3)):
    return Request(index=index, prompt_ids=list(prompt), params=SamplingParams(max_tokens=10_000), seed=0,
                   history=None if history is None else list(history))


def accepted(steps):
    return sum(a for _, _, a in steps)


def test_protocol_and_name():
    p = HistoryProposer()
    assert isinstance(p, Proposer) and p.name == "history"


def test_identical_history_is_drafted_and_accepted_entirely():
    hist = list(range(100, 150))
    prop, req = HistoryProposer(), make_req(hist)
    steps = run(prop, req, hist, k=8)
    # every step drafts the next 8 old tokens and all are accepted (+1 bonus)
    assert all(d == hist[pos : pos + 8] and a == len(d) for pos, d, a in steps)
    assert len(steps) == -(-len(hist) // 9)


def test_never_more_than_k_and_chunks_follow_the_pointer():
    hist = list(range(40))
    prop, req = HistoryProposer(), make_req(hist)
    assert drafted(prop, req, 3) == [0, 1, 2]
    assert drafted(prop, req, 3) == [0, 1, 2]  # deterministic without new tokens
    assert drafted(prop, req, 0) == []
    req.output_ids.extend([0, 1, 2, 3])
    observe(prop, req, None, 0, [0, 1, 2, 3])
    assert drafted(prop, req, 5) == [4, 5, 6, 7, 8]
    assert req.proposer_state["history"].index is None  # aligned: no n-gram index built
    req.output_ids = list(hist)
    assert drafted(prop, req, 5) == []  # old response exhausted


def test_no_history_no_draft():
    prop = HistoryProposer()
    for h in (None, []):
        req = make_req(h)
        assert drafted(prop, req, 4) == []
        req.output_ids.append(7)
        observe(prop, req, None, 0, [7])
        assert drafted(prop, req, 4) == []
        finish(prop, req)
        assert req.proposer_state == {}


def test_one_token_substitution_recovers_right_after_the_change():
    hist = list(range(100, 160))
    target = list(hist)
    target[30] = 7  # a new token in the middle
    prop, req = HistoryProposer(), make_req(hist)
    steps = run(prop, req, target, k=8)
    # the step that emitted the changed token is followed by a draft of hist[31:]
    (after,) = [(pos, d) for pos, d, _ in steps if pos == 31]
    assert after[1] == hist[31:39]
    assert all(d for _, d, _ in steps)  # never without a draft
    assert [pos for pos, d, a in steps if a < len(d)] == [27]  # only the change cost a rejection


def test_insertion_recovers_by_suffix_match():
    hist = list(range(100, 160))
    target = hist[:20] + [1, 2, 3] + hist[20:]
    prop, req = HistoryProposer(), make_req(hist)
    steps = run(prop, req, target, k=8)
    by_pos = {pos: (d, a) for pos, d, a in steps}
    # as soon as the first old token follows the insertion (hist[20] at position 23), the
    # pointer re-aligns near where it was lost and drafting resumes
    assert by_pos[24] == (hist[21:29], 8)
    assert all(a == len(d) and d for pos, d, a in steps if pos >= 24)


def test_deletion_recovers_immediately():
    hist = list(range(100, 160))
    target = hist[:20] + hist[25:]  # five old tokens gone
    prop, req = HistoryProposer(), make_req(hist)
    steps = run(prop, req, target, k=8)
    # at most two steps after the change are lost
    wasted = [pos for pos, d, a in steps if a < len(d) or not d]
    assert len(wasted) <= 3
    assert accepted(steps) >= len(target) - 3 * len(steps)


def test_prefers_the_occurrence_nearest_after_the_old_pointer():
    block = [5, 6, 7, 8]
    hist = [1] + block + [20, 21] + [2] + block + [30, 31] + [3] + block + [40, 41]
    # the new response diverges after the second block's prefix and then repeats the block
    target = [1] + block + [20, 21] + [2] + [9, 9] + block
    prop, req = HistoryProposer(), make_req(hist)
    req.output_ids = list(target)
    prop._sync(req)
    # last 4 tokens match all three blocks equally: the one after the old pointer wins
    assert drafted(prop, req, 2) == [30, 31]


def test_longest_match_wins_over_nearer_shorter():
    hist = [50, 51, 5, 6, 60, 61, 70, 71, 72, 5, 6, 80, 81]
    prop, req = HistoryProposer(), make_req(hist)
    req.output_ids = [90, 91, 92, 71, 72, 5, 6]  # matches hist[7:11] best
    assert drafted(prop, req, 2) == [80, 81]


def test_long_insertion_recovers_at_the_first_old_token():
    hist = list(range(100, 160))
    target = hist[:20] + list(range(1, 21)) + hist[20:]
    prop, req = HistoryProposer(), make_req(hist)
    steps = run(prop, req, target, k=8)
    by_pos = {pos: (d, a) for pos, d, a in steps}
    assert by_pos[41] == (hist[21:29], 8)
    assert all(a == len(d) and d for pos, d, a in steps if pos >= 41)


def test_long_deletion_recovers_by_bigram_match():
    hist = list(range(100, 160))
    target = hist[:20] + hist[35:]  # resumes far from where the alignment was lost
    prop, req = HistoryProposer(), make_req(hist)
    steps = run(prop, req, target, k=8)
    by_pos = {pos: (d, a) for pos, d, a in steps}
    assert by_pos[22] == (hist[37:45], 8)  # two old tokens in a row: the bigram index finds them
    assert all(a == len(d) and d for pos, d, a in steps if pos >= 22)


def test_unrelated_response_offers_nothing_after_the_guess():
    hist = list(range(100, 140))
    target = list(range(1000, 1040))
    prop, req = HistoryProposer(), make_req(hist)
    steps = run(prop, req, target, k=4)
    positions = [pos for pos, d, _ in steps if d]
    assert positions[:2] == [0, 1]  # the start of the old response, then one substitution guess
    assert len(positions) == 2


def test_state_is_per_request_and_cleaned():
    prop = HistoryProposer()
    a, b = make_req([1, 2, 3, 4], index=0), make_req([9, 8, 7, 6], index=1)
    assert drafted(prop, a, 2) == [1, 2]
    assert drafted(prop, b, 2) == [9, 8]
    a.output_ids.append(1)
    observe(prop, a, None, 0, [1])
    assert drafted(prop, a, 2) == [2, 3] and drafted(prop, b, 2) == [9, 8]
    finish(prop, a)
    finish(prop, b)
    finish(prop, b)  # idempotent
    assert a.proposer_state == {} and b.proposer_state == {}


def test_tokens_from_other_proposers_are_followed():
    """Tokens emitted from someone else's draft (many per step) keep the pointer in sync."""
    hist = list(range(100, 200))
    prop, req = HistoryProposer(), make_req(hist)
    req.output_ids.extend(hist[:37])
    observe(prop, req, None, 0, hist[:37])
    assert drafted(prop, req, 4) == hist[37:41]


@pytest.mark.parametrize("seed", range(5))
def test_random_edits_never_break_and_reuse_a_lot(seed):
    rng = random.Random(seed)
    hist = [rng.randrange(1000) for _ in range(300)]
    target = list(hist)
    for _ in range(6):  # substitutions, insertions, deletions
        i = rng.randrange(10, len(target) - 10)
        op = rng.choice("sid")
        if op == "s":
            target[i] = rng.randrange(1000, 2000)
        elif op == "i":
            target[i:i] = [rng.randrange(1000, 2000) for _ in range(rng.randint(1, 4))]
        else:
            del target[i : i + rng.randint(1, 4)]
    prop, req = HistoryProposer(), make_req(hist)
    steps = run(prop, req, target, k=16)
    assert len(steps) < len(target) / 5  # most of the response came from history


def test_evidence_is_the_agreement_behind_the_alignment():
    hist = list(range(100, 160))
    prop, req = HistoryProposer(), make_req(hist, prompt=(1, 2, 3))
    assert propose(prop, req, 4).evidence == 3  # the prompt: the old response was drawn from the same one
    req.output_ids = hist[:10]
    observe(prop, req)
    assert propose(prop, req, 4).evidence == 13  # + ten old tokens followed from the start
    req.output_ids = hist[:10] + [7, 7] + hist[30:35]  # an edit: re-aligned on hist[30:35]
    observe(prop, req)
    d = propose(prop, req, 2)
    assert d.tokens == hist[35:37]
    assert d.evidence == 5  # only the re-alignment's match backs the draft now


def test_confidence_is_the_old_policy_probability_of_each_draft_token():
    import math

    r = Request(0, [1], SamplingParams(), 0, history=[5, 6, 7, 8], history_logprobs=[-0.1, -0.2, -0.3, -0.4])
    h = HistoryProposer()
    d = propose(h, r, 2)
    assert d.tokens == [5, 6]
    assert d.confidence == pytest.approx([math.exp(-0.1), math.exp(-0.2)])
    r.output_ids = [5, 6]
    observe(h, r, d, 2, [5, 6])
    d = propose(h, r, 5)
    assert d.tokens == [7, 8]
    assert d.confidence == pytest.approx([math.exp(-0.3), math.exp(-0.4)])
    assert propose(HistoryProposer(), Request(1, [1], SamplingParams(), 0, history=[5]), 1).confidence is None


def test_old_logprobs_only_where_the_draft_sits_at_the_old_position():
    import math

    def req():
        return Request(0, [1], SamplingParams(), 0, history=[5, 6, 7, 8], history_logprobs=[-0.1, -0.2, -0.3, -0.4])

    h, r = HistoryProposer(), req()
    assert lenient.old_logprobs(r, propose(h, r, 3)) == pytest.approx([-0.1, -0.2, -0.3])
    r = req()
    r.output_ids = [6]  # the old first token was deleted: the draft [7, 8] sits one position early
    observe(h, r, None, 0, [6])
    d = propose(h, r, 2)
    assert d.tokens == [7, 8] and all(math.isnan(x) for x in lenient.old_logprobs(r, d))
    r = Request(1, [1], SamplingParams(), 0, history=[5])
    assert lenient.old_logprobs(r, propose(h, r, 1)) is None  # no old logprobs known
