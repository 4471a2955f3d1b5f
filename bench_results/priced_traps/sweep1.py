"""Step-1 work: plain vs spec configs interleaved."""
import sys, os, statistics
from demo_work import PROPOSERS as P, config, interleave, policy_and_work
from rollout import Engine, SpecConfig
policy, w1 = policy_and_work(1)
cfg = config
engines = {"plain": Engine(policy, cfg(None))}
for k in (4, 8, 16, 24):
    engines[f"priced k{k}"] = Engine(policy, cfg(SpecConfig(proposers=P, max_draft_tokens=k)))
for k in (4, 8, 16):
    engines[f"fixed0 k{k}"] = Engine(policy, cfg(SpecConfig(proposers=P, max_draft_tokens=k, min_draft_prob=0.0)))
engines["fixed0.5 k24"] = Engine(policy, cfg(SpecConfig(proposers=P, max_draft_tokens=24, min_draft_prob=0.5)))
T = interleave(engines, w1, int(sys.argv[1]))
for n, v in T.items():
    print(f"{n:14s} min {min(v):.2f} med {statistics.median(v):.2f}  plain/this min {min(T['plain'])/min(v):.2f}")
print(os.getloadavg())
