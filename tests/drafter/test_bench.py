"""The offline benchmark's pieces run on a tiny model (the benchmark itself needs the demo policy)."""
import random

from drafter.bench import sample_rollouts, time_steps
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
