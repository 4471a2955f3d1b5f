"""The demo's step-1 work (bench_results/cpu_ceiling/prof1.py's /tmp/s44 files: the policy after
one GRPO update and the work with step 0's responses as history), plain, the priced budget and
fixed length 4 at max_draft_tokens=4, two rounds in one process; run from the code to test
(PYTHONPATH), processes alternated by k4_processes.sh."""
import os, pickle, sys, time
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
es = {"plain": Engine(policy, cfg(None)), "priced k4": Engine(policy, cfg(SpecConfig(proposers=P, max_draft_tokens=4))),
      "fixed 4": Engine(policy, cfg(SpecConfig(proposers=P, max_draft_tokens=4, min_draft_prob=0.0)))}
go = lambda e: e.generate(w1["prompts"], w1["params"], seeds=w1["seeds"], drafts=w1["drafts"], groups=w1["groups"],
                          draft_logprobs=w1["draft_lps"])
for r in range(2):
    for n, e in es.items():
        t = time.perf_counter(); go(e); dt = time.perf_counter() - t
        print(sys.argv[1], r, n, round(dt, 3), e.last_run, flush=True)
