"""A cell of the spec bench (python trace_bench_cell.py WORKLOAD BATCH): plain and priced alternated, 4 rounds; per run the
priced engine's speculating and plain steps (count, seconds, drafted, emitted beyond one a row)."""
import sys, time, os, argparse
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
from rollout import bench_spec as B
from rollout import plain_reference as pr
args = argparse.Namespace(vocab=4096, hidden=512, layers=4, tokens=48, threads=1, device="cpu")
w = B.prepare(sys.argv[1], int(sys.argv[2]), args)
trace = []
orig = pr.PlainReference.observe
def obs(self, policy, fed, drafted, rows, emitted, seconds, work=None):
    orig(self, policy, fed, drafted, rows, emitted, seconds, work)
    trace.append((policy, fed, drafted, rows, emitted, seconds))
pr.PlainReference.observe = obs
for r in range(4):
    for c in ("plain", "priced"):
        trace.clear()
        t, _, outs = B.run_once(w, c)
        spec = [x for x in trace if x[0] is not None]
        plain = [x for x in trace if x[0] is None]
        print(r, c, f"{t:.3f}s steps {len(trace)} spec {len(spec)} spec_s {sum(x[5] for x in spec):.3f} plain_s {sum(x[5] for x in plain):.3f}",
              "drafted", sum(x[2] for x in spec), "emitted-rows", sum(x[4]-x[3] for x in spec),
              "mean plain step ms", round(1e3*sum(x[5] for x in plain)/max(len(plain),1), 2),
              "mean spec step ms", round(1e3*sum(x[5] for x in spec)/max(len(spec),1), 2))
        if c == "priced" and r == 3:
            print([ (x[0] and x[0][0], x[2], round(x[5]*1e3,1)) for x in trace[:20]])
