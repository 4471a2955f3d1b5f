"""Demo steps 0 and 1 on one spec engine (its ledgers carried from step 0 to step 1), the plain
engine beside. argv: variant (old: a run's draft sources ignored, as before; new: as committed)
num_problems. Run the variants alternately, one process each."""
import os, sys, time
import torch
import rollout.controller as rc
from rollout import Engine, EngineConfig, SpecConfig
from rollout.model import CausalLM
from drafter.bench import demo_policy
from drafter.bench_engine import step_work, grpo_update
variant = sys.argv[1]
if variant == "old":
    orig = rc.AdaptiveController.new_run
    rc.AdaptiveController.new_run = lambda self, sources=frozenset(): orig(self, frozenset())
torch.set_num_threads(1)
hf, tok, folder, make_problems, TaskConfig = demo_policy()
policy = CausalLM.from_pretrained(folder, device="cpu")
problems = make_problems(TaskConfig(num_problems=int(sys.argv[2]), seed=0))
prompts = [tok(p.prompt)["input_ids"] for p in problems]
eos = tok.eos_token_id
P = ("history", "suffix", "lookahead")
cfg = lambda s: EngineConfig(max_batch_size=64, max_model_len=1024, max_num_batched_tokens=2048, device="cpu", spec=s)
plain, spec = Engine(policy, cfg(None)), Engine(policy, cfg(SpecConfig(proposers=P, max_draft_tokens=24)))
def go(e, w):
    t = time.perf_counter()
    o = e.generate(w["prompts"], w["params"], seeds=w["seeds"], drafts=w["drafts"], groups=w["groups"], draft_logprobs=w["draft_lps"])
    return o, time.perf_counter() - t
w0 = step_work(prompts, 8, 0, eos)
o0p, tp0 = go(plain, w0)
o0s, ts0 = go(spec, w0)
r0 = spec.last_run
assert [o.token_ids for o in o0p] == [o.token_ids for o in o0s]
grpo_update(hf, tok, policy, {"p": (plain, None), "s": (spec, None)}, w0, o0p, [p.answer for p in problems])
w1 = step_work(prompts, 8, 1, eos, previous=o0p)
o1s, ts1 = go(spec, w1)
r1 = spec.last_run
o1p, tp1 = go(plain, w1)
assert [o.token_ids for o in o1p] == [o.token_ids for o in o1s]
print(f"{variant:3} step0 plain {tp0:.2f} spec {ts0:.2f} ({tp0/ts0:.2f}x) off {r0.spec_off_steps}/{r0.steps} | "
      f"step1 plain {tp1:.2f} spec {ts1:.2f} ({tp1/ts1:.2f}x) off {r1.spec_off_steps}/{r1.steps} load {os.getloadavg()[0]:.2f}", flush=True)
