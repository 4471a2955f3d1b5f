import sys, time, os, pickle
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
from rollout import Engine, EngineConfig, SpecConfig
from rollout import plain_reference as pr
from rollout.model import CausalLM
from drafter.bench import demo_policy
torch.set_num_threads(1)
hf, tok, folder, make_problems, TaskConfig = demo_policy()
policy = CausalLM.from_pretrained(folder, device="cpu")
policy.load_state_dict(torch.load("/tmp/s44/policy1.pt"))
w1 = pickle.load(open("/tmp/s44/w1.pkl", "rb"))
P = ("history", "suffix", "lookahead")
k = int(sys.argv[1])
cfg = lambda s: EngineConfig(max_batch_size=64, max_model_len=1024, max_num_batched_tokens=2048, device="cpu", spec=s)
e = Engine(policy, cfg(SpecConfig(proposers=P, max_draft_tokens=k)))
orig = pr.PlainReference.observe
def obs(self, policy, fed, drafted, rows, emitted, seconds, work=None):
    before = {n: (l.off_left, l.ratio) for n, l in self.ledgers.items()}
    orig(self, policy, fed, drafted, rows, emitted, seconds, work)
    pl = self.cost.predict(rows, work.context if work else 0) if self.measured else None
    print(f"{policy} fed={fed} dr={drafted} rows={rows} em={emitted} s={seconds*1e3:.2f}ms plain1={(pl or 0)*1e3:.2f} "
          + " ".join(f"{n}:off{l.off_left} r{l.ratio:.2f} rec{l.record_ratio or 0:.2f} w{l.wait}" for n, l in self.ledgers.items()))
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
go = lambda e: e.generate(w1["prompts"], w1["params"], seeds=w1["seeds"], drafts=w1["drafts"], groups=w1["groups"], draft_logprobs=w1["draft_lps"])
t = time.perf_counter(); go(e); print("T", time.perf_counter() - t, e.last_run)
