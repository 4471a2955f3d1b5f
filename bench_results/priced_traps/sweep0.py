"""Step-0 work (no history): plain vs spec configs interleaved."""
import sys, os, statistics
from demo_work import PROPOSERS as P, config, interleave, policy_and_work
from rollout import Engine, SpecConfig
policy, w0 = policy_and_work(0)
cfg = config
engines = {"plain": Engine(policy, cfg(None)), "plain again": Engine(policy, cfg(None))}
engines["priced k24"] = Engine(policy, cfg(SpecConfig(proposers=P, max_draft_tokens=24)))
engines["priced k8"] = Engine(policy, cfg(SpecConfig(proposers=P, max_draft_tokens=8)))
for k in (2, 4, 8):  # (the "after" run: (8,), and fixed0.5 left out)
    engines[f"fixed0 k{k}"] = Engine(policy, cfg(SpecConfig(proposers=P, max_draft_tokens=k, min_draft_prob=0.0)))
engines["fixed0.5 k8"] = Engine(policy, cfg(SpecConfig(proposers=P, max_draft_tokens=8, min_draft_prob=0.5)))
T = interleave(engines, w0, int(sys.argv[1]))
for n, v in T.items():
    print(f"{n:14s} min {min(v):.2f} med {statistics.median(v):.2f}  this/plain median-of-ratios {statistics.median(a/b for a, b in zip(v, T['plain'])):.3f}")
print(os.getloadavg())
