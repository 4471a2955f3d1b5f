"""Step-0 work (no history): plain vs spec configs interleaved."""
import sys, time, os, pickle, statistics
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
from rollout import Engine, EngineConfig, SpecConfig
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
cfg = lambda s: EngineConfig(max_batch_size=64, max_model_len=1024, max_num_batched_tokens=2048, device="cpu", spec=s)
engines = {"plain": Engine(policy, cfg(None)), "plain again": Engine(policy, cfg(None))}
engines["priced k24"] = Engine(policy, cfg(SpecConfig(proposers=P, max_draft_tokens=24)))
engines["priced k8"] = Engine(policy, cfg(SpecConfig(proposers=P, max_draft_tokens=8)))
for k in (2, 4, 8):  # (the "after" run: (8,), and fixed0.5 left out)
    engines[f"fixed0 k{k}"] = Engine(policy, cfg(SpecConfig(proposers=P, max_draft_tokens=k, min_draft_prob=0.0)))
engines["fixed0.5 k8"] = Engine(policy, cfg(SpecConfig(proposers=P, max_draft_tokens=8, min_draft_prob=0.5)))
go = lambda e: e.generate(w0["prompts"], w0["params"], seeds=w0["seeds"], groups=w0["groups"])
T = {n: [] for n in engines}
for i in range(int(sys.argv[1])):
    for name, e in engines.items():
        t = time.perf_counter(); out = go(e); dt = time.perf_counter() - t
        T[name].append(dt)
        print(i, name, round(dt, 2), e.last_run, flush=True)
for n, v in T.items():
    print(f"{n:14s} min {min(v):.2f} med {statistics.median(v):.2f}  this/plain median-of-ratios {statistics.median(a/b for a, b in zip(v, T['plain'])):.3f}")
print(os.getloadavg())
