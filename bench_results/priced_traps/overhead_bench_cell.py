"""A cell of the spec bench (python overhead_bench_cell.py WORKLOAD BATCH): plain and priced alternated, 3 rounds; the
milliseconds each engine and controller function took in each run."""
import sys, time, os, argparse, statistics
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from rollout import bench_spec as B
from rollout import engine as E, controller as C, critical_path as CP
args = argparse.Namespace(vocab=4096, hidden=512, layers=4, tokens=48, threads=1, device="cpu")
w = B.prepare(sys.argv[1], int(sys.argv[2]), args)
acc = {}
def timed(cls, name):
    f = getattr(cls, name)
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); acc[name] = acc.get(name, 0) + time.perf_counter() - t; return r
    setattr(cls, name, g)
for cls, n in ((C.AdaptiveController, "plan_step"), (C.AdaptiveController, "observe_step"), (CP.RunTally, "step"),
               (E.Engine, "_plan"), (E.Engine, "_verify"), (E.Engine, "_step"), (E.Engine, "_sample"), (E.Engine, "_accept"),
               (C.AdaptiveController, "choose"), (C.AdaptiveController, "record")):
    timed(cls, n)
wo = E.Work.of
def wof(rows):
    t = time.perf_counter(); r = wo(rows); acc["Work.of"] = acc.get("Work.of", 0) + time.perf_counter() - t; return r
E.Work.of = staticmethod(wof)
for c in ("plain", "priced", "plain", "priced", "plain", "priced"):
    acc.clear(); t, _, _ = B.run_once(w, c)
    print(c, round(t, 3), {k: round(v * 1e3, 1) for k, v in sorted(acc.items())})
