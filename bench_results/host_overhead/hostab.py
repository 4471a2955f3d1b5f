import sys, time, pickle, hashlib, torch
from rollout import Engine, EngineConfig, SpecConfig
from rollout.model import CausalLM
from drafter.bench import demo_policy
torch.set_num_threads(1)
hf, tok, folder, *_ = demo_policy()
hf.load_state_dict(torch.load("bench_results/host_overhead/w1.pt"))
import tempfile
d = tempfile.mkdtemp(); hf.save_pretrained(d)
policy = CausalLM.from_pretrained(d, device="cpu")
w1, prompts = pickle.load(open("bench_results/host_overhead/w1.pkl", "rb"))
thr = sys.argv[1]
spec = SpecConfig(proposers=("history", "suffix", "lookahead"), max_draft_tokens=24, min_draft_prob=None if thr == "priced" else float(thr))
e = Engine(policy, EngineConfig(max_batch_size=64, max_model_len=1024, device="cpu", spec=spec))
acc = [0.0]; f = policy.forward
def wrapped(batch, cache):
    t = time.perf_counter(); out = f(batch, cache); acc[0] += time.perf_counter() - t; return out
policy.forward = wrapped
for r in range(int(sys.argv[2])):
    acc[0] = 0
    t = time.perf_counter()
    o = e.generate(w1["prompts"], w1["params"], seeds=w1["seeds"], drafts=w1["drafts"], groups=w1["groups"], draft_logprobs=w1["draft_lps"])
    s = time.perf_counter() - t
    h = hashlib.md5(str([x.token_ids for x in o]).encode()).hexdigest()[:8]
    print(f"RESULT total {s:.3f} forward {acc[0]:.3f} host {s-acc[0]:.3f} steps {e.last_run.steps} tokens {h}", flush=True)
