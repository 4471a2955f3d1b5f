"""The demo's step-1 work (bench_results/cpu_ceiling/prof1.py's /tmp/s44 files: the policy after
one GRPO update and the work with step 0's responses as history), plain, the priced budget and
fixed length 4 at max_draft_tokens=4, two rounds in one process; run from the code to test
(PYTHONPATH), processes alternated by k4_processes.sh."""
import sys
from demo_work import PROPOSERS as P, config, interleave, policy_and_work
from rollout import Engine, SpecConfig
policy, w1 = policy_and_work(1)
cfg = config
es = {"plain": Engine(policy, cfg(None)), "priced k4": Engine(policy, cfg(SpecConfig(proposers=P, max_draft_tokens=4))),
      "fixed 4": Engine(policy, cfg(SpecConfig(proposers=P, max_draft_tokens=4, min_draft_prob=0.0)))}
interleave(es, w1, 2, label=sys.argv[1])
