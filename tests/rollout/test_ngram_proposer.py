"""NgramProposer (prompt lookup): the last n tokens seen before predict what follows them."""
from rollout.config import SamplingParams
from rollout.core.request import Request
from rollout.proposers.base import Proposer
from rollout.proposers.ngram import NgramProposer
from tests.rollout.proposer_sim import propose


def make_req(prompt, output=()):
    r = Request(index=0, prompt_ids=list(prompt), params=SamplingParams(max_tokens=100), seed=0)
    r.output_ids = list(output)
    return r


def test_longest_ngram_wins_and_evidence_is_its_length():
    prop = NgramProposer((3, 2, 1))
    assert isinstance(prop, Proposer) and prop.name == "ngram"
    d = propose(prop, make_req([5, 6, 7, 8, 9, 1, 6, 7], [8]), 2)  # "6 7 8" occurred before, then 9 1
    assert d.tokens == [9, 1] and d.evidence == 3 and d.proposer is prop
    d = propose(prop, make_req([5, 6, 7, 8, 9, 1, 2], [7]), 3)  # only "7" recurs: a unigram match
    assert d.tokens == [8, 9, 1] and d.evidence == 1
    assert propose(prop, make_req([5, 6], [7]), 3) is None  # nothing recurs: no draft


def test_a_hit_must_sit_on_a_token_boundary():
    # packed as little-endian int32, 256 then 0 reads 00 01 00 00 00 00 00 00: the bytes of
    # token 1 (01 00 00 00) sit at offset 1, inside two other tokens, and must not count
    prop = NgramProposer((1,))
    req = make_req([256, 0, 4], [1])
    assert bytes(__import__("array").array("i", [256, 0]))[1:5] == bytes(__import__("array").array("i", [1]))
    assert propose(prop, req, 2) is None
