"""The engine's verify loop for one request, without a model: proposer tests drive it."""


def drafted(prop, req, k):
    """The tokens a proposer drafts now ([] for no draft)."""
    draft = prop.propose(req, k)
    return [] if draft is None else draft.tokens


def step(prop, req, target, k=8):
    """One engine step: draft, accept the matching prefix, emit accepted + 1 correct, observe."""
    pos = len(req.output_ids)
    d = prop.propose(req, k)
    draft = [] if d is None else d.tokens
    assert len(draft) <= k and all(t >= 0 for t in draft)
    truth = target[pos : pos + len(draft)]
    acc = 0
    while acc < len(draft) and acc < len(truth) and draft[acc] == truth[acc]:
        acc += 1
    emitted = target[pos : pos + acc + 1]
    req.output_ids.extend(emitted)
    prop.observe(req, d, acc, emitted)
    return pos, draft, acc


def run(prop, req, target, k=8):
    """Steps until the request's output is `target`; returns the per-step (pos, draft, accepted)."""
    steps = []
    while len(req.output_ids) < len(target):
        steps.append(step(prop, req, target, k))
    prop.finish(req)
    assert req.output_ids == target
    assert prop.name not in req.proposer_state  # finish() dropped the request's state
    return steps
