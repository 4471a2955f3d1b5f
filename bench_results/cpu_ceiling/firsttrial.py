"""Demo steps 0 and 1 on one spec engine (its ledger carried from step 0 to step 1), plain beside.
argv: variant (A: as is, B: a run's first trial judged on >= TRIAL steps) num_problems"""
import sys, time, os, copy
import torch
import rollout.plain_reference as pr
from rollout import Engine, EngineConfig, SpecConfig
from rollout.model import CausalLM
from drafter.bench import demo_policy
from drafter.bench_engine import step_work, grpo_update
variant = sys.argv[1]
if variant == "B":
    orig_new_run = pr.PlainReference.new_run
    def new_run(self, decay):
        orig_new_run(self, decay)
        for l in self.ledgers.values():
            l._first = True
    pr.PlainReference.new_run = new_run
    orig_trial = pr.Ledger.trial.fget
    pr.Ledger.trial = property(lambda self: max(orig_trial(self), pr.TRIAL) if getattr(self, "_first", False) else orig_trial(self))
    orig_add = pr.Ledger.add
    def add(self, seconds, plain):
        orig_add(self, seconds, plain)
        if self.sums[0] == 0 or self.judged:
            self._first = False
    pr.Ledger.add = add
torch.set_num_threads(1)
hf, tok, folder, make_problems, TaskConfig = demo_policy()
policy = CausalLM.from_pretrained(folder, device="cpu")
problems = make_problems(TaskConfig(num_problems=int(sys.argv[2]), seed=0))
prompts = [tok(p.prompt)["input_ids"] for p in problems]
eos = tok.eos_token_id
P = ("history", "suffix", "lookahead")
cfg = lambda s: EngineConfig(max_batch_size=64, max_model_len=1024, max_num_batched_tokens=2048, device="cpu", spec=s)
plain, spec = Engine(policy, cfg(None)), Engine(policy, cfg(SpecConfig(proposers=P, max_draft_tokens=24)))
def go(e, w, step):
    t = time.perf_counter()
    o = e.generate(w["prompts"], w["params"], seeds=w["seeds"], drafts=w["drafts"], groups=w["groups"], draft_logprobs=w["draft_lps"])
    return o, time.perf_counter() - t
w0 = step_work(prompts, 8, 0, eos)
o0p, tp0 = go(plain, w0, 0)
o0s, ts0 = go(spec, w0, 0)
r0 = spec.last_run
assert [o.token_ids for o in o0p] == [o.token_ids for o in o0s]
led = {k: (l.wait, l.lost, l.record_ratio) for k, l in spec.controller.plain.ledgers.items()}
grpo_update(hf, tok, policy, {"p": (plain, None), "s": (spec, None)}, w0, o0p, [p.answer for p in problems])
w1 = step_work(prompts, 8, 1, eos, previous=o0p)
o1s, ts1 = go(spec, w1, 1)
r1 = spec.last_run
o1p, tp1 = go(plain, w1, 1)
assert [o.token_ids for o in o1p] == [o.token_ids for o in o1s]
print(f"{variant} step0 plain {tp0:.2f} spec {ts0:.2f} ({tp0/ts0:.2f}x) off {r0.spec_off_steps}/{r0.steps} ledgers {led} | "
      f"step1 plain {tp1:.2f} spec {ts1:.2f} ({tp1/ts1:.2f}x) off {r1.spec_off_steps}/{r1.steps} load {os.getloadavg()[0]:.2f}", flush=True)
