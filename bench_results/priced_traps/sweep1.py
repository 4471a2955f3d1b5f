"""Step-1 work: plain vs spec configs interleaved."""
import sys, time, os, pickle, statistics
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
from rollout import Engine, EngineConfig, SpecConfig
from rollout.model import CausalLM
from drafter.bench import demo_policy
torch.set_num_threads(1)
hf, tok, folder, make_problems, TaskConfig = demo_policy()
policy = CausalLM.from_pretrained(folder, device="cpu")
policy.load_state_dict(torch.load("/tmp/s44/policy1.pt"))
w1 = pickle.load(open("/tmp/s44/w1.pkl", "rb"))
P = ("history", "suffix", "lookahead")
cfg = lambda s: EngineConfig(max_batch_size=64, max_model_len=1024, max_num_batched_tokens=2048, device="cpu", spec=s)
engines = {"plain": Engine(policy, cfg(None))}
for k in (4, 8, 16, 24):
    engines[f"priced k{k}"] = Engine(policy, cfg(SpecConfig(proposers=P, max_draft_tokens=k)))
for k in (4, 8, 16):
    engines[f"fixed0 k{k}"] = Engine(policy, cfg(SpecConfig(proposers=P, max_draft_tokens=k, min_draft_prob=0.0)))
engines["fixed0.5 k24"] = Engine(policy, cfg(SpecConfig(proposers=P, max_draft_tokens=24, min_draft_prob=0.5)))
go = lambda e: e.generate(w1["prompts"], w1["params"], seeds=w1["seeds"], drafts=w1["drafts"], groups=w1["groups"], draft_logprobs=w1["draft_lps"])
T = {n: [] for n in engines}
for i in range(int(sys.argv[1])):
    for name, e in engines.items():
        t = time.perf_counter(); out = go(e); dt = time.perf_counter() - t
        T[name].append(dt)
        print(i, name, round(dt, 2), e.last_run, flush=True)
for n, v in T.items():
    print(f"{n:14s} min {min(v):.2f} med {statistics.median(v):.2f}  plain/this min {min(T['plain'])/min(v):.2f}")
print(os.getloadavg())
