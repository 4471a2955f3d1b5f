"""The plain reference's ledgers at each speculating step of the demo's step-0 work, two runs: python trace_step0.py K"""
import sys, time
from demo_work import PROPOSERS as P, config, generate, ledgers, policy_and_work
from rollout import Engine, SpecConfig
from rollout import plain_reference as pr
policy, w0 = policy_and_work(0)
k = int(sys.argv[1])
cfg = config
e = Engine(policy, cfg(SpecConfig(proposers=P, max_draft_tokens=k)))
orig = pr.PlainReference.observe
step = [0]
def obs(self, policy, fed, drafted, rows, emitted, seconds, work=None):
    orig(self, policy, fed, drafted, rows, emitted, seconds, work)
    step[0] += 1
    if policy is not None or step[0] < 3:
        pl = self.cost.predict(rows, work.context if work else 0) if self.measured else 0
        print(f"{step[0]} {policy} fed={fed} dr={drafted} rows={rows} em={emitted} s={seconds*1e3:.2f}ms plain1={pl*1e3:.2f} " + ledgers(self))
pr.PlainReference.observe = obs
go = lambda e: generate(e, w0)
for i in range(2):
    step[0] = 0
    t = time.perf_counter(); go(e); print("T", time.perf_counter() - t, e.last_run)
