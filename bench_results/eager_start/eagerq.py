"""The spec bench's cells with one more configuration, interleaved: "priced q", the priced budget
with eager's first halvings set to --start and, with --old-gate, eager gated at its own length
(the code before EAGER_START: --start 0 --old-gate)."""
import sys, os, argparse, random, statistics, json
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from rollout import bench_spec as bs
ap = argparse.ArgumentParser()
ap.add_argument("--workloads", default="zero,low")
ap.add_argument("--batches", default="1,8")
ap.add_argument("--rounds", type=int, default=6)
ap.add_argument("--start", type=int, default=2)
ap.add_argument("--out", default="/tmp/s44/eagerq.json")
ap.add_argument("--old-gate", action="store_true")
a = ap.parse_args()
args = argparse.Namespace(vocab=4096, hidden=512, layers=4, tokens=48, threads=None, device="cpu")
rows = []
for wl in a.workloads.split(","):
    for b in map(int, a.batches.split(",")):
        w = bs.prepare(wl, b, args)
        import dataclasses
        from rollout import Engine
        base = w["engines"]["priced"]
        q = Engine(base.model, base.config)
        q.controller.plain.ledgers["eager"].shorter = a.start
        if a.old_gate:
            import types
            from rollout import step_cost
            from rollout.plain_reference import EAGER_MAX_COST, POLICIES
            def old_policy(self, running, context=0):
                if not (self.priced and self.checks_plain):
                    return POLICIES[0]
                plain = self.cost.predict(running, context)
                n = self.plain.eager_length(self.max_draft_tokens) + 1
                full = self.cost.predict(running * n, n * context + running * step_cost.attended(0, n - 1))
                return self.plain.choose(eager_ok=0 < plain and full <= EAGER_MAX_COST * plain)
            q.controller.policy = types.MethodType(old_policy, q.controller)
        w["engines"]["priced q"] = q
        names = list(w["engines"])
        for c in names:
            bs.run_once(w, c)
        times = {c: [] for c in names}
        toks = {}
        for r in range(a.rounds):
            for c in random.Random(r).sample(names, len(names)):
                s, _, outs = bs.run_once(w, c)
                times[c].append(s)
                toks[c] = [o.token_ids for o in outs]
        assert all(t == toks["plain"] for t in toks.values()), "tokens differ"
        med = {c: statistics.median(t) for c, t in times.items()}
        fixed = {c: v for c, v in med.items() if c.startswith("fixed") or c == "plain"}
        best = min(fixed, key=fixed.get)
        row = {"workload": wl, "batch": b, "median_s": med, "best_fixed": best,
               "priced_over_plain": bs.paired(times["priced"], times["plain"]),
               "priced_over_best": bs.paired(times["priced"], times[best]),
               "q_over_plain": bs.paired(times["priced q"], times["plain"]),
               "q_over_best": bs.paired(times["priced q"], times[best]),
               "aa": bs.paired(times["plain again"], times["plain"]), "times": times,
               "eager_length_end": {k: w["engines"][k].controller.plain.eager_length(16) for k in ("priced", "priced q")}}
        rows.append(row)
        print(f"{wl:7} b{b:<3} " + " ".join(f"{c} {v:.2f}" for c, v in med.items())
              + f" | best {best} priced/plain {row['priced_over_plain']:.3f} priced/best {row['priced_over_best']:.3f}"
              f" q/plain {row['q_over_plain']:.3f} q/best {row['q_over_best']:.3f} A/A {row['aa']:.3f} eager len end {row['eager_length_end']} load {os.getloadavg()[0]:.2f}", flush=True)
        json.dump({"rounds": a.rounds, "start_shorter": a.start, "rows": rows}, open(a.out, "w"), indent=1)
