"""Demo step 0 on the plain engine: two engines on one copy of the weights against an engine on a
copy of its own, alternated (does where a copy lies move a rollout's time?)."""
import os, sys, time, statistics
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
from rollout import Engine, EngineConfig
from rollout.model import CausalLM
from drafter.bench import demo_policy
from drafter.bench_engine import step_work
torch.set_num_threads(1)
hf, tok, folder, make_problems, TaskConfig = demo_policy()
problems = make_problems(TaskConfig(num_problems=64, seed=0))
prompts = [tok(p.prompt)["input_ids"] for p in problems]
w0 = step_work(prompts, 8, 0, tok.eos_token_id)
cfg = EngineConfig(max_batch_size=64, max_model_len=1024, max_num_batched_tokens=2048, device="cpu")
shared = CausalLM.from_pretrained(folder, device="cpu")
engines = {"A shared": Engine(shared, cfg), "B shared": Engine(shared, cfg),
           "C own copy": Engine.from_pretrained(folder, cfg)}
t = {k: [] for k in engines}
for r in range(int(sys.argv[1])):
    for k, e in engines.items():
        s = time.perf_counter(); e.generate(w0["prompts"], w0["params"], seeds=w0["seeds"], groups=w0["groups"]); t[k].append(time.perf_counter() - s)
    print(r, {k: round(v[-1], 2) for k, v in t.items()}, flush=True)
for k in ("B shared", "C own copy"):
    q = [x / a for x, a in zip(t[k], t["A shared"])]
    print(f"{k} over A shared: median {statistics.median(q):.3f} min {min(q):.3f} max {max(q):.3f}")
print("load", os.getloadavg())
