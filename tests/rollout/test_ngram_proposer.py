"""NgramProposer (prompt lookup): the last n tokens seen before predict what follows them."""
from rollout.config import SamplingParams
from rollout.proposers import NgramProposer
from rollout.proposers.base import Proposer
from rollout.request import Request


def make_req(prompt, output=()):
    r = Request(index=0, prompt_ids=list(prompt), params=SamplingParams(max_tokens=100), seed=0)
    r.output_ids = list(output)
    return r


def test_longest_ngram_wins_and_evidence_is_its_length():
    prop = NgramProposer((3, 2, 1))
    assert isinstance(prop, Proposer) and prop.name == "ngram"
    req = make_req([5, 6, 7, 8, 9, 1, 6, 7], [8])  # "6 7 8" occurred before, followed by 9 1
    assert prop.propose(req, 2) == [9, 1] and prop.evidence(req) == 3
    req = make_req([5, 6, 7, 8, 9, 1, 2], [7])  # only "7" recurs: a unigram match
    assert prop.propose(req, 3) == [8, 9, 1] and prop.evidence(req) == 1
    req = make_req([5, 6], [7])  # nothing recurs: no draft, no evidence
    assert prop.propose(req, 3) == [] and prop.evidence(req) == 0
    prop.finish(req)
    assert prop.evidence(req) == 0


def test_a_hit_must_sit_on_a_token_boundary():
    # packed as little-endian int32, 256 then 0 reads 00 01 00 00 00 00 00 00: the bytes of
    # token 1 (01 00 00 00) sit at offset 1, inside two other tokens, and must not count
    prop = NgramProposer((1,))
    req = make_req([256, 0, 4], [1])
    assert bytes(__import__("array").array("i", [256, 0]))[1:5] == bytes(__import__("array").array("i", [1]))
    assert prop.propose(req, 2) == [] and prop.evidence(req) == 0
