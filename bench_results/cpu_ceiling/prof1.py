"""Demo step-1 work (history after one GRPO update) on the default spec engine, profiled."""
import sys, time, os, cProfile, pstats, pickle
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
from rollout import Engine, EngineConfig, SpecConfig
from rollout.model import CausalLM
from drafter.bench import demo_policy
from drafter.bench_engine import step_work, grpo_update
torch.set_num_threads(1)
hf, tok, folder, make_problems, TaskConfig = demo_policy()
policy = CausalLM.from_pretrained(folder, device="cpu")
problems = make_problems(TaskConfig(num_problems=64, seed=0))
prompts = [tok(p.prompt)["input_ids"] for p in problems]
eos = tok.eos_token_id
P = ("history", "suffix", "lookahead")
cfg = lambda s: EngineConfig(max_batch_size=64, max_model_len=1024, max_num_batched_tokens=2048, device="cpu", spec=s)
plain = Engine(policy, cfg(None))
w0 = step_work(prompts, 8, 0, eos)
o0 = plain.generate(w0["prompts"], w0["params"], seeds=w0["seeds"], groups=w0["groups"])
grpo_update(hf, tok, policy, {"p": (plain, None)}, w0, o0, [p.answer for p in problems])
w1 = step_work(prompts, 8, 1, eos, previous=o0)
torch.save({k: v.clone() for k, v in policy.state_dict().items()}, "/tmp/s44/policy1.pt")
pickle.dump(w1, open("/tmp/s44/w1.pkl", "wb"))
spec = Engine(policy, cfg(SpecConfig(proposers=P, max_draft_tokens=24)))
go = lambda e: e.generate(w1["prompts"], w1["params"], seeds=w1["seeds"], drafts=w1["drafts"], groups=w1["groups"], draft_logprobs=w1["draft_lps"])
t = time.perf_counter(); go(plain); print("plain", time.perf_counter() - t)
t = time.perf_counter(); go(spec); print("spec warm", time.perf_counter() - t, spec.last_run)
pr = cProfile.Profile(); pr.enable()
t = time.perf_counter(); go(spec); s = time.perf_counter() - t
pr.disable()
print("spec profiled", s, spec.last_run)
pstats.Stats(pr).sort_stats("tottime").print_stats(45)
