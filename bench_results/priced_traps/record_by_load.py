"""The demo's step-0 work, run after run on the same engines (each run after the first has the
last runs' record): plain, the priced budget, and the priced budget reading its record over every
load (the code before 472d0ce and f003a67, by an instance-level patch), alternated in one process:
python record_by_load.py ROUNDS"""
import os, statistics, sys
from demo_work import PROPOSERS, config, interleave, policy_and_work
from rollout import Engine, SpecConfig

policy, work = policy_and_work(0)
engines = {"plain": Engine(policy, config(None)),
           "priced": Engine(policy, config(SpecConfig(proposers=PROPOSERS, max_draft_tokens=24))),
           "priced, record over all loads": Engine(policy, config(SpecConfig(proposers=PROPOSERS, max_draft_tokens=24)))}
for ledger in engines["priced, record over all loads"].controller.plain.ledgers.values():
    ledger.winning_at = lambda rows, ledger=ledger: ledger.winning
times = interleave(engines, work, int(sys.argv[1]))
for n, v in times.items():
    later = [a / b for a, b in zip(v[1:], times["plain"][1:])]
    print(f"{n:30s} median {statistics.median(v):.3f}s  over plain, runs after the first: {statistics.median(later):.3f}")
print("load average", os.getloadavg())
