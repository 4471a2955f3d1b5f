"""The spec bench's low/batch-1 cell: priced's per-step choices against fixed 4."""
import sys, time, os, argparse, collections, statistics
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
from rollout import bench_spec as bs
args = argparse.Namespace(vocab=4096, hidden=512, layers=4, tokens=48, threads=None, device="cpu")
w = bs.prepare(sys.argv[1] if len(sys.argv) > 1 else "low", 1, args)
e = w["engines"]["priced"]
log = []
c = e.controller
orig = c.observe_step
def obs(fed, emitted, seconds, batched=0.0, **kw):
    log.append((kw.get("policy"), fed, kw.get("drafted", 0), emitted, seconds))
    return orig(fed, emitted, seconds, batched, **kw)
c.observe_step = obs
names = ["plain", "priced", "fixed 4", "fixed 2"]
for n in names:
    bs.run_once(w, n)
for r in range(int(sys.argv[2]) if len(sys.argv) > 2 else 3):
    res = {}
    for n in names:
        if n == "priced": log.clear()
        res[n] = bs.run_once(w, n)[0]
        if n == "priced": plog = list(log)
    log = plog
    pol = collections.Counter(x[0] for x in log)
    dr = collections.Counter((x[0], x[2]) for x in log if x[0] is not None)
    sec = collections.defaultdict(list)
    for x in log: sec[(x[0], x[2] > 0)].append(x[4])
    print(" ".join(f"{n} {v:.2f}" for n, v in res.items()), "| priced steps", len(log), dict(pol),
          "emitted", sum(x[3] for x in log), "drafted", sum(x[2] for x in log), "step-sum", round(sum(x[4] for x in log), 2))
    print("   draft lengths by policy", sorted(dr.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])))
    print("   ms per step:", {str(k): (len(v), round(1e3 * statistics.median(v), 1)) for k, v in sec.items()})
    pr = c.plain
    print("   ledgers", {k: (l.record_ratio and round(l.record_ratio, 3), l.shorter, l.wait, l.runs) for k, l in pr.ledgers.items()},
          "preferred", pr.preferred, "plane", [round(x * 1e3, 3) for x in pr.cost.plane()], flush=True)
