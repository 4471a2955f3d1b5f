import sys, time, os, pickle
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
from rollout import Engine, EngineConfig, SpecConfig
from rollout import plain_reference as pr
from rollout.model import CausalLM
from drafter.bench import demo_policy
from drafter.bench_engine import step_work
torch.set_num_threads(1)
hf, tok, folder, make_problems, TaskConfig = demo_policy()
policy = CausalLM.from_pretrained(folder, device="cpu")
problems = make_problems(TaskConfig(num_problems=64, seed=0))
prompts = [tok(p.prompt)["input_ids"] for p in problems]
w0 = step_work(prompts, 8, 0, tok.eos_token_id)
P = ("history", "suffix", "lookahead")
k = int(sys.argv[1])
cfg = lambda s: EngineConfig(max_batch_size=64, max_model_len=1024, max_num_batched_tokens=2048, device="cpu", spec=s)
e = Engine(policy, cfg(SpecConfig(proposers=P, max_draft_tokens=k)))
orig = pr.PlainReference.observe
step = [0]
def obs(self, policy, fed, drafted, rows, emitted, seconds, work=None):
    orig(self, policy, fed, drafted, rows, emitted, seconds, work)
    step[0] += 1
    if policy is not None or step[0] < 3:
        pl = self.cost.predict(rows, work.context if work else 0) if self.measured else 0
        print(f"{step[0]} {policy} fed={fed} dr={drafted} rows={rows} em={emitted} s={seconds*1e3:.2f}ms plain1={pl*1e3:.2f} "
          + " ".join(f"{n}:off{l.off_left} r{l.ratio:.2f} rec{l.record_ratio or 0:.2f} w{l.wait}" for n, l in self.ledgers.items()))
pr.PlainReference.observe = obs
go = lambda e: e.generate(w0["prompts"], w0["params"], seeds=w0["seeds"], groups=w0["groups"])
for i in range(2):
    step[0] = 0
    t = time.perf_counter(); go(e); print("T", time.perf_counter() - t, e.last_run)
