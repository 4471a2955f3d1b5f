"""The plain reference's ledgers and the price at each step of the demo's step-1 work: python trace_k4.py K"""
import sys, time
from demo_work import PROPOSERS as P, config, generate, ledgers, policy_and_work
from rollout import Engine, SpecConfig
from rollout import plain_reference as pr
policy, w1 = policy_and_work(1)
k = int(sys.argv[1])
cfg = config
e = Engine(policy, cfg(SpecConfig(proposers=P, max_draft_tokens=k)))
orig = pr.PlainReference.observe
def obs(self, policy, fed, drafted, rows, emitted, seconds, work=None):
    orig(self, policy, fed, drafted, rows, emitted, seconds, work)
    pl = self.cost.predict(rows, work.context if work else 0) if self.measured else None
    print(f"{policy} fed={fed} dr={drafted} rows={rows} em={emitted} s={seconds*1e3:.2f}ms plain1={(pl or 0)*1e3:.2f} " + ledgers(self))
pr.PlainReference.observe = obs
from rollout import controller as C
origp = C.AdaptiveController.plan_step
def ps(self, proposers, running, load, context=0):
    r = origp(self, proposers, running, load, context)
    if self.priced:
        pt = self.token_cost(running, context); v = self.token_value(running, pt, context)
        print(f"  plan thr={self.threshold(load, running, context):.3f} cost={pt*1e6:.1f}us value={v*1e6:.1f}us plane={[round(x*1e6,2) for x in self.cost.plane()]} share={self.critical_share:.2f}")
    return r
C.AdaptiveController.plan_step = ps
go = lambda e: generate(e, w1)
t = time.perf_counter(); go(e); print("T", time.perf_counter() - t, e.last_run)
