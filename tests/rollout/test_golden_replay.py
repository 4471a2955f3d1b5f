"""A fixed workload replayed against a golden file: the same tokens, the same per-proposer
proposed / accepted counts, the same forwards per request and the same engine step count as
when the file was made. The cases run the default budget (rollout/budget/budget.py) with a step-cost
table given here, so the drafts do not depend on the machine. Refactors of the engine, the
proposers and the budget must leave all of it unchanged; a change that means to alter the
drafts regenerates the file on purpose (tokens must never change):

    SPECTAIL_REGEN_GOLDEN=1 python -m pytest tests/rollout/test_golden_replay.py

float64, so that no reordering of a reduction can flip a near-tie.
"""
import json
import os
from pathlib import Path

import pytest
import torch

from rollout import Engine, EngineConfig, SamplingParams, SpecConfig
from tests.conftest import tiny_hf_model

GOLDEN = Path(__file__).parent / "golden" / "replay.json"
VOCAB = 61
PROMPTS = [[5, 6, 7, 5, 6, 7], [9, 1, 2, 3, 4], [11, 11, 12, 13], [3, 1, 4, 1, 5, 9, 2, 6]]
SAMPLES = 4  # a GRPO group per prompt
ALL = ("history", "suffix", "lookahead", "ngram")
FIXED = 0.3  # a fixed threshold, pinned by two cases
# A memory-bound machine's shape: feeding 8 tokens costs about what feeding 1 does, then each
# token costs more; attention over the context adds a little.
COST = {"tokens": [1, 8, 16, 64, 512], "seconds": [1.0, 1.1, 1.6, 4.0, 30.0], "per_attended": 1e-4,
        "per_attended_draft": 2e-5}
CASES = {  # name -> (batch size, SpecConfig keyword arguments, per-request params)
    "all_b1": (1, dict(proposers=ALL, max_draft_tokens=8, step_cost=COST), "plain"),
    "all_b3": (3, dict(proposers=ALL, max_draft_tokens=8, step_cost=COST), "plain"),
    "all_b16": (16, dict(proposers=ALL, max_draft_tokens=8, step_cost=COST), "plain"),
    "all_b16_every_token": (16, dict(proposers=ALL, max_draft_tokens=6, min_draft_prob=0.0), "plain"),
    "all_b5_topk_topp": (5, dict(proposers=ALL, max_draft_tokens=8, step_cost=COST), "filtered"),
    "ngram_b4_spec_cap": (4, dict(proposers=("ngram",), max_draft_tokens=4, max_batch_for_spec=2,
                                  min_draft_prob=FIXED), "plain"),
    # lenient acceptance keeps old tokens a draft offers: its tokens depend on the drafts, so it
    # runs the fixed threshold, whose drafts the budget's cost model never moves
    "history_lenient_b8": (8, dict(proposers=("history", "suffix"), max_draft_tokens=8, lenience=3.0,
                                   min_draft_prob=FIXED), "plain"),
}


def peaked_model():
    """A random Llama made nearly a Markov chain over a fixed permutation of the vocabulary
    (lm_head aligned with the permuted embeddings, the layers' writes to the residual damped),
    so responses repeat themselves and their siblings: drafts land often but not always, and
    every path of the verify loop runs."""
    hf = tiny_hf_model("llama", vocab=VOCAB, seed=5, dtype=torch.float64)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.5)
            layer.mlp.down_proj.weight.mul_(0.5)
        emb = hf.model.embed_tokens.weight
        inv = torch.argsort(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3)))
        rows = emb[inv]
        hf.lm_head.weight.copy_(6.0 * rows / (rows.norm(dim=1, keepdim=True) * emb.shape[1] ** 0.5))
    return hf


def nudged(hf, scale=0.03, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * v.std() * torch.randn(v.shape, generator=g, dtype=v.dtype)
            if v.is_floating_point() and v.numel() > 1 else v for k, v in hf.state_dict().items()}


def params_for(kind):
    if kind == "filtered":
        return [SamplingParams(temperature=0.9, top_k=12, top_p=0.9, max_tokens=36, stop_token_ids=[0]),
                SamplingParams(temperature=1.2, top_p=0.8, max_tokens=30, stop_token_ids=[0])]
    return [SamplingParams(temperature=1.0, max_tokens=40, stop_token_ids=[0])]


def replay(batch, spec_kw, kind):
    """Two epochs: the first drafts from siblings, lookahead and n-grams; the second, after a
    weight update and with fresh seeds, also from the first epoch's responses."""
    hf = peaked_model()
    eng = Engine.from_pretrained(hf, EngineConfig(max_batch_size=batch, max_model_len=64, dtype="float64",
                                                  spec=SpecConfig(**spec_kw)))
    ids = [p for p in PROMPTS for _ in range(SAMPLES)]
    groups = [g for g in range(len(PROMPTS)) for _ in range(SAMPLES)]
    kinds = params_for(kind)
    params = [kinds[i % len(kinds)] for i in range(len(ids))]
    record, history = [], None
    for epoch in range(2):
        if epoch:
            eng.update_weights(nudged(hf))
        seeds = [100 * epoch + i for i in range(len(ids))]
        outs = eng.generate(ids, params, seeds=seeds, groups=groups,
                            drafts=None if history is None else [o.token_ids for o in history],
                            draft_logprobs=None if history is None else [o.logprobs for o in history])
        record.append({"steps": eng.last_run.steps, "tokens": [o.token_ids for o in outs],
                       "forward_passes": [o.stats["forward_passes"] for o in outs],
                       "proposed": [o.stats["proposed"] for o in outs],
                       "accepted": [o.stats["accepted"] for o in outs],
                       "lenient": [o.stats["lenient"] for o in outs]})
        history = outs
    return record


@pytest.fixture(scope="module")
def golden():
    if os.environ.get("SPECTAIL_REGEN_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps({name: replay(*case) for name, case in CASES.items()}) + "\n")
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("name", list(CASES))
def test_replay_matches_golden(golden, name):
    got, want = replay(*CASES[name]), golden[name]
    for epoch, (g, w) in enumerate(zip(got, want)):
        assert g["tokens"] == w["tokens"], f"{name} epoch {epoch}: tokens"
        for key in ("proposed", "accepted", "forward_passes", "lenient"):
            assert g[key] == w[key], f"{name} epoch {epoch}: {key}"
        assert g["steps"] == w["steps"], f"{name} epoch {epoch}: engine steps"


def test_the_workload_exercises_every_proposer(golden):
    """A golden file that never drafts would pin nothing: every proposer must have drafted and
    been both accepted and rejected somewhere, and the lenient case must have been lenient."""
    proposed, accepted = {}, {}
    for case in golden.values():
        for epoch in case:
            for p, a in zip(epoch["proposed"], epoch["accepted"]):
                for name, n in p.items():
                    proposed[name] = proposed.get(name, 0) + n
                    accepted[name] = accepted.get(name, 0) + a.get(name, 0)
    for name in ALL:
        assert 0 < accepted[name] < proposed[name], (name, accepted.get(name), proposed.get(name))
    assert sum(sum(e["lenient"]) for e in golden["history_lenient_b8"]) > 0
