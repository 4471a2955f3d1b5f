"""The engine's verify loop for one request, without a model: proposer tests drive it through the
proposer contract (rollout/proposers/base.py)."""
from rollout.proposers.base import StepResult, Verified


def propose(prop, req, k):
    """The proposer's draft for one request (None: none)."""
    return prop.propose([req], k)[0]


def observe(prop, req, draft=None, accepted=0, emitted=(), samples=(), logprobs=()):
    """A step's result for one request, in a step the budget let `prop` draft."""
    row = Verified(req, draft, accepted, list(emitted), list(samples), list(logprobs))
    return prop.on_step(StepResult(rows=(row,), drafting=frozenset({prop})))


def finish(prop, req):
    """req leaves the engine."""
    return prop.on_step(StepResult(left=(req,)))


def drop_group(prop, group):
    return prop.on_step(StepResult(dropped=frozenset({group})))


def drafted(prop, req, k):
    """The tokens a proposer drafts now ([] for no draft)."""
    draft = propose(prop, req, k)
    return [] if draft is None else draft.tokens


def step(prop, req, target, k=8):
    """One engine step: draft, accept the matching prefix, emit accepted + 1 correct, observe."""
    pos = len(req.output_ids)
    d = propose(prop, req, k)
    draft = [] if d is None else d.tokens
    assert len(draft) <= k and all(t >= 0 for t in draft)
    truth = target[pos : pos + len(draft)]
    acc = 0
    while acc < len(draft) and acc < len(truth) and draft[acc] == truth[acc]:
        acc += 1
    emitted = target[pos : pos + acc + 1]
    req.output_ids.extend(emitted)
    observe(prop, req, d, acc, emitted)
    return pos, draft, acc


def run(prop, req, target, k=8):
    """Steps until the request's output is `target`; returns the per-step (pos, draft, accepted)."""
    steps = []
    while len(req.output_ids) < len(target):
        steps.append(step(prop, req, target, k))
    finish(prop, req)
    assert req.output_ids == target
    assert prop.name not in req.proposer_state  # leaving dropped the request's state
    return steps
