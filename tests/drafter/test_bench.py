"""The offline benchmark's pieces run on a tiny model (the benchmark itself needs the demo policy)."""
import random

from benchmarks.bench_drafter import sample_rollouts, time_steps
from drafter.head import DraftHead, HeadConfig
from rollout import Engine, EngineConfig


def test_bench_pieces(policy):
    engine = Engine(policy, EngineConfig(max_batch_size=8, max_model_len=64))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 101) for _ in range(4)] for _ in range(3)]
    rolls = sample_rollouts(engine, prompts, samples=2, step=0, eos=2)
    assert len(rolls) == 6 and rolls[0].prompt_ids == rolls[1].prompt_ids and rolls[0].seed != rolls[1].seed
    again = sample_rollouts(engine, prompts, samples=2, step=0, eos=2)
    assert [r.response_ids for r in again] == [r.response_ids for r in rolls]  # seeds fix the samples
    head = DraftHead.for_policy(policy, HeadConfig(), seed=0)
    cost = time_steps(policy, head, batch=4, ctx=8, reps=2)
    assert cost["head_step"]["min_s"] > 0 and cost["ratio_median"] > 0 and cost["batch"] == 4


def test_the_choice_log_sees_every_choice_and_scores_both_drafts(policy):
    """benchmarks/bench_drafter_choice.py: watching `choose` changes no token and no draft; a duel's runs are
    each draft's common prefix with the output."""
    from types import SimpleNamespace

    from benchmarks.bench_drafter_choice import ChoiceLog
    from drafter.proposer import DrafterProposer
    from rollout import SamplingParams, SpecConfig

    spec = SpecConfig(proposers=("suffix", "drafter"), max_draft_tokens=4, min_draft_prob=0.0)
    prompts, params = [[5, 6, 7, 8]] * 4, SamplingParams(temperature=1.0, max_tokens=24)
    outs = {}
    for watched in (False, True):
        engine = Engine(policy, EngineConfig(max_batch_size=4, max_model_len=64, spec=spec))
        DrafterProposer.of(engine).set_head(DraftHead.for_policy(policy, HeadConfig(), seed=0), 1)
        log = ChoiceLog(engine) if watched else None
        got = engine.generate(prompts, params, seeds=[1, 2, 3, 4], groups=[0, 0, 0, 0])
        outs[watched] = ([o.token_ids for o in got], [o.stats["proposed"] for o in got])
    assert outs[True] == outs[False]
    assert log.chooses > 0 and sum(log.won.values()) <= log.chooses and log.thresholds
    out = [SimpleNamespace(token_ids=[1, 2, 3, 4, 5])]
    log.duels = [((0, 1), "suffix", [2, 3, 9], "drafter", [2, 9]), ((0, 0), "suffix", [1, 2], "drafter", [1, 2, 3])]
    assert log.realized(out) == {"suffix<drafter": {"count": 2, "winner_run_mean": 2.0, "loser_run_mean": 2.0,
                                                    "loser_better": 1, "tokens_lost": 1}}
