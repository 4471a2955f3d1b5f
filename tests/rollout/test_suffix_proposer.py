"""SuffixProposer: a GRPO group's responses draft for each other."""
import random

import pytest

from rollout.config import SamplingParams
from rollout.core.request import Request
from rollout.proposers.base import Proposer
from rollout.proposers.suffix import SuffixIndex, SuffixProposer
from tests.rollout.proposer_sim import drafted, drop_group, finish, observe, propose, run, step


def make_req(index=0, group=0, history=None, prompt=(1, 2, 3)):
    return Request(index=index, prompt_ids=list(prompt), params=SamplingParams(max_tokens=10_000), seed=index,
                   history=history, group=group)


def add_finished(prop, group, responses):
    """Siblings that finished earlier: each is registered, indexed and leaves."""
    for i, resp in enumerate(responses):
        r = make_req(1000 + i, group=group)
        r.output_ids = list(resp)
        observe(prop, r)
        finish(prop, r)


def group_index(prop, group):
    return prop._groups.get(("group", group))


def test_protocol_and_name():
    p = SuffixProposer()
    assert isinstance(p, Proposer) and p.name == "suffix"


def test_finished_sibling_is_drafted_from_the_start():
    prop = SuffixProposer()
    resp = list(range(200, 240))
    run(prop, make_req(0), resp)  # first sibling: nothing to draft from but itself
    steps = run(prop, make_req(1), resp)  # second sibling: same response
    assert steps[0][1] == resp[:8]  # the empty output drafts the sibling's beginning
    assert all(a == len(d) == 8 for _, d, a in steps[:-1])
    assert len(steps) == -(-len(resp) // 9)


def test_sibling_in_flight_drafts_as_its_tokens_arrive():
    prop = SuffixProposer()
    lead, follow = make_req(0), make_req(1)
    shared = list(range(300, 330))
    a_target = shared + [1, 2, 3]
    b_target = shared + [4, 5, 6]
    for _ in range(12):  # the lead runs ahead alone (one token per step: nothing to draft)
        step(prop, lead, a_target)
    assert len(lead.output_ids) == 12
    pos, draft, acc = step(prop, follow, b_target)
    assert (pos, draft, acc) == (0, shared[:8], 8)
    # the follower catches up to the lead's end and stops drafting there
    pos, draft, acc = step(prop, follow, b_target)
    assert (pos, draft, acc) == (9, shared[9:12], 3)
    step(prop, lead, a_target)  # the lead emits one more token
    assert drafted(prop, follow, 8) == shared[13:14]


def test_min_share_stops_at_a_fork():
    prop = SuffixProposer(min_share=0.6)
    add_finished(prop, 7, [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8, 9]])
    req = make_req(group=7)
    assert drafted(prop, req, 8) == [1, 2, 3]  # 50/50 after 3: stop
    req.output_ids = [1, 2, 3, 7]
    assert drafted(prop, req, 8) == [8, 9]  # past the fork the branch is unique again
    loose = SuffixProposer(min_share=0.3)
    add_finished(loose, 7, [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8, 9]])
    assert drafted(loose, make_req(group=7), 8) == [1, 2, 3, 4, 5, 6]  # tie -> smaller id
    add_finished(prop, 7, [[1, 2, 3, 7, 8, 0]])
    assert drafted(prop, make_req(index=1, group=7), 8) == [1, 2, 3, 7, 8]  # 7 has 2/3 now; then 9 vs 0


def test_longest_context_wins_over_frequency():
    prop = SuffixProposer(min_share=0.5)
    add_finished(prop, 0, [[5, 6, 7, 8, 100], [9, 6, 7, 8, 200], [1, 6, 7, 8, 200]])
    req = make_req(group=0)
    req.output_ids = [40, 5, 6, 7, 8]
    assert drafted(prop, req, 4) == [100]
    other = make_req(index=1, group=0)
    other.output_ids = [40, 3, 6, 7, 8]
    assert drafted(prop, other, 4) == [200]  # only 6 7 8 matches: 200 has 2 of 3


def test_own_tokens_never_match_their_own_end():
    prop = SuffixProposer()
    req = make_req(group=None)
    req.output_ids = [5, 6, 7]
    assert drafted(prop, req, 8) == []
    req.output_ids = [1, 2, 3, 9, 1, 2]
    assert drafted(prop, req, 8) == [3, 9, 1, 2]  # its own earlier text continues; stops at its end


def test_history_is_indexed_once_and_private_index_is_freed():
    prop = SuffixProposer()
    hist = list(range(50, 70))
    req = make_req(group=None, history=hist)
    steps = run(prop, req, hist, k=4)
    assert all(a == len(d) == 4 for _, d, a in steps)
    assert prop._groups == {} and req.proposer_state == {}
    # in a group, each request's history is shared with its siblings
    a = make_req(0, group=3, history=hist)
    drafted(prop, a, 4)
    b = make_req(1, group=3)
    assert drafted(prop, b, 4) == hist[:4]
    index = group_index(prop, 3)
    assert sum(1 for s in index.seqs if s[1:] == hist) == 1
    drafted(prop, a, 4)
    assert sum(1 for s in index.seqs if s[1:] == hist) == 1


def test_groups_are_separate_and_finish_keeps_the_group():
    prop = SuffixProposer()
    run(prop, make_req(0, group=1), [10, 11, 12, 13, 14])
    assert drafted(prop, make_req(1, group=2), 4) == []
    assert group_index(prop, 1) is not None  # finish() kept it
    assert drafted(prop, make_req(2, group=1), 4) == [10, 11, 12, 13]
    drop_group(prop, 1)
    assert group_index(prop, 1) is None
    drop_group(prop, 1)  # idempotent


def test_a_dropped_group_is_rebuilt_for_a_live_request():
    prop = SuffixProposer()
    req = make_req(0, group=1)
    req.output_ids = [1, 2, 1]
    assert drafted(prop, req, 4) == [2, 1]
    drop_group(prop, 1)
    assert drafted(prop, req, 4) == [2, 1]  # re-registered with its full output
    # the id is reused by a new group (dropped, then fed again): still consistent
    drop_group(prop, 1)
    add_finished(prop, 1, [[7, 7, 7, 8]])
    req.output_ids.append(2)
    assert drafted(prop, req, 4) == [1, 2]
    assert group_index(prop, 1).seqs == [[-1, 7, 7, 7, 8], [-1, 1, 2, 1, 2]]  # the live request joined it


def test_k_and_max_depth_are_respected():
    prop = SuffixProposer(max_depth=3)
    add_finished(prop, 0, [list(range(100))])
    req = make_req(group=0)
    assert drafted(prop, req, 5) == [0, 1, 2, 3, 4]
    assert drafted(prop, req, 0) == []
    req.output_ids = [99, 98, 20, 21, 22]
    assert drafted(prop, req, 3) == [23, 24, 25]
    index = group_index(prop, 0)
    assert index.match(req.output_ids, 3, 64) == (3, [(0, 24)])  # position in [START] + response


def test_index_is_linear_in_tokens():
    index = SuffixIndex()
    s = index.add_sequence(list(range(1000)))
    assert sum(len(q) - 1 for q in index.seqs) == 1000
    # one entry per position per indexed n-gram length, whatever max_depth is
    assert sum(len(v) for g in index.grams for v in g.values()) <= 3 * 1001
    assert index.match([-1], 32, 64) == (1, [(s, 1)])  # START: the response's beginning


@pytest.mark.parametrize("seed", range(3))
def test_group_of_similar_siblings_reuses_a_lot(seed):
    """Eight siblings that share most of their text, generated in lockstep."""
    rng = random.Random(seed)
    base = [rng.randrange(500) for _ in range(120)]
    targets = []
    for _ in range(8):
        t = list(base)
        for _ in range(3):
            i = rng.randrange(len(t))
            t[i] = rng.randrange(500, 600)
        targets.append(t)
    prop = SuffixProposer()
    reqs = [make_req(i, group=0) for i in range(8)]
    steps = {i: [] for i in range(8)}
    while any(len(r.output_ids) < len(t) for r, t in zip(reqs, targets)):
        for i, (r, t) in enumerate(zip(reqs, targets)):
            if len(r.output_ids) < len(t):
                steps[i].append(step(prop, r, t, k=8))
    for r in reqs:
        finish(prop, r)
        assert r.proposer_state == {}
    total_steps = sum(len(s) for s in steps.values())
    assert total_steps < sum(map(len, targets)) / 3


def test_evidence_is_the_match_length_and_a_match_from_start_counts_the_prompt():
    prop = SuffixProposer()
    add_finished(prop, 0, [list(range(100, 140))])
    req = make_req(group=0, prompt=(1, 2, 3, 4))
    d = propose(prop, req, 3)
    assert d.tokens == [100, 101, 102]
    assert d.evidence == 4  # [START] matched: the shared prompt backs the draft
    req.output_ids = [9, 9, 120, 121, 122]
    d = propose(prop, req, 2)
    assert d.tokens == [123, 124]
    assert d.evidence == 3  # 120 121 122
    other = make_req(index=1, group=0)
    other.output_ids = [5, 6, 7, 8]  # occurs nowhere else
    assert propose(prop, other, 2) is None


def test_drafts_carry_the_confidence_of_their_source_tokens():
    import math

    def req(i, out=(), lps=(), **kw):
        r = Request(i, [1, 2], SamplingParams(), i, group=7, **kw)
        r.output_ids, r.logprobs = list(out), list(lps)
        return r

    sfx = SuffixProposer()
    observe(sfx, req(0, [3, 4, 9], [-0.2, -0.3, -1.5]))
    b = req(1, history=[3, 4, 5, 6], history_logprobs=[0.0, -0.1, -2.0, -0.5])
    # b's old response is indexed after the sibling, so it is the newest source of 3 and 4; at the
    # fork (5 or 9, one each) the smaller id wins; then only the old response goes on
    d = propose(sfx, b, 4)
    assert d.tokens == [3, 4, 5, 6]
    assert d.confidence == pytest.approx([1.0, math.exp(-0.1), math.exp(-2.0), math.exp(-0.5)])
    observe(sfx, req(2, [3, 4], [-0.7, -0.8]))  # a newer sibling speaks for 3 and 4
    d = propose(sfx, b, 2)
    assert d.tokens == [3, 4]
    assert d.confidence == pytest.approx([math.exp(-0.7), math.exp(-0.8)])
    nan = float("nan")
    observe(sfx, req(3, [3], [nan]))  # continued from elsewhere: its logprob is unknown
    d = propose(sfx, b, 1)
    assert d.tokens == [3]
    assert d.confidence == pytest.approx([math.exp(-0.7)])  # the newest that knows it
    solo, other = SuffixProposer(), req(5)
    observe(solo, req(4, [3], [nan]))
    d = propose(solo, other, 1)
    assert d.tokens == [3] and math.isnan(d.confidence[0])  # none knows it


def _reference_follow(index, occs, k, min_share):
    """follow, one token at a time: the majority continuation (ties: smaller id) while its share
    holds, and the confidence of its newest occurrence that knows it (-1: none does)."""
    live = [(index.seqs[s], index.probs[s], p) for s, p in occs]
    draft, conf = [], []
    while live and len(draft) < k:
        nexts = [seq[p] for seq, _, p in live if p < len(seq)]
        if not nexts:
            break
        counts = {}
        for t in nexts:
            counts[t] = counts.get(t, 0) + 1
        tok, cnt = min(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        if cnt < min_share * len(nexts) or tok < 0:
            break
        live = [(seq, probs, p + 1) for seq, probs, p in live if p < len(seq) and seq[p] == tok]
        draft.append(tok)
        conf.append(next((probs[p - 1] for _, probs, p in live if probs[p - 1] >= 0), -1.0))
    return draft, conf


@pytest.mark.parametrize("seed", range(6))
def test_match_and_follow_agree_with_a_token_by_token_reference(seed):
    """The index follows agreeing occurrences a run at a time; that must draft exactly what the
    token-by-token majority walk drafts, confidences included (unknown ones as -1 or NaN)."""
    rng = random.Random(seed)
    index = SuffixIndex()
    base = [rng.randrange(4) for _ in range(60)]
    for _ in range(8):  # siblings: the same text with a few edits, so occurrences agree for runs
        seq = [t if rng.random() > 0.08 else rng.randrange(4) for t in base][: rng.randint(20, 60)]
        probs = [rng.choice([-1.0, float("nan"), rng.random()]) if rng.random() < 0.3 else rng.random()
                 for _ in seq]
        index.add_sequence(seq, probs)
    for _ in range(200):
        s = rng.randrange(len(index.seqs))
        ctx = index.seqs[s][: rng.randint(1, len(index.seqs[s]))]
        m, occs = index.match(ctx, max_depth=rng.choice([2, 8, 32]), max_candidates=rng.choice([1, 4, 16]))
        if not occs:
            continue
        k, share = rng.randint(1, 30), rng.choice([0.0, 0.3, 0.6])
        got, got_conf = index.follow(occs, k, share)
        want, want_conf = _reference_follow(index, occs, k, share)
        assert got == want
        assert [q if q >= 0 else -1.0 for q in got_conf] == pytest.approx(want_conf)
