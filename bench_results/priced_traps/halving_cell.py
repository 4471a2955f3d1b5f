"""A cell of the spec bench (python halving_cell.py WORKLOAD BATCH ROUNDS): plain, the priced budget, and the priced
budget without the load rule (a switched-off policy tried again once half as many requests run; turned off by an
instance-level patch), alternated in one process; medians of the per-round ratios to plain."""
import argparse, os, statistics, sys, dataclasses
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from rollout import Engine
from rollout import bench_spec as B

args = argparse.Namespace(vocab=4096, hidden=512, layers=4, tokens=48, threads=1, device="cpu")
w = B.prepare(sys.argv[1], int(sys.argv[2]), args)
priced = w["engines"]["priced"]
held = Engine(priced.model, dataclasses.replace(priced.config))
choose = held.controller.plain.choose
held.controller.plain.choose = lambda eager_ok=False, running=0: choose(eager_ok)
w["engines"]["priced, waits held"] = held
names = ("plain", "plain again", "priced", "priced, waits held")
times = {n: [] for n in names}
for r in range(int(sys.argv[3])):
    for n in names:
        t, _, outs = B.run_once(w, n)
        times[n].append(t)
for n in names:
    print(f"{n:20s} median {statistics.median(times[n]):.3f}s  over plain {statistics.median(a / b for a, b in zip(times[n], times['plain'])):.4f}")
print("load average", os.getloadavg())
