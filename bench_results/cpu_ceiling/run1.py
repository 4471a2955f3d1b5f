"""Step-1 work from /tmp/s44 (prof1.py's files): spec runs N times (for a sampling profiler)."""
import sys, time, os, pickle
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
spec = Engine(policy, cfg(SpecConfig(proposers=P, max_draft_tokens=24)))
go = lambda e: e.generate(w1["prompts"], w1["params"], seeds=w1["seeds"], drafts=w1["drafts"], groups=w1["groups"], draft_logprobs=w1["draft_lps"])
for i in range(int(sys.argv[1])):
    t = time.perf_counter(); go(spec); print("spec", round(time.perf_counter() - t, 2), spec.last_run, flush=True)
