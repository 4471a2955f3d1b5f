"""Demo step-1 work (512 requests, history from step 0 after one GRPO update): plain vs spec
variants, interleaved; per-step fed/emitted logged for the spec runs."""
import sys, time, json, os, statistics
import torch
from rollout import Engine, EngineConfig, SpecConfig
from rollout.model import CausalLM
from drafter.bench import demo_policy
from drafter.bench_engine import step_work, grpo_update
torch.set_num_threads(1)
hf, tok, folder, make_problems, TaskConfig = demo_policy()
policy = CausalLM.from_pretrained(folder, device="cpu")
problems = make_problems(TaskConfig(num_problems=int(sys.argv[1]), seed=0))
prompts = [tok(p.prompt)["input_ids"] for p in problems]
eos = tok.eos_token_id
P = ("history", "suffix", "lookahead")
variants = {"plain": None}
for v in sys.argv[3].split(","):
    name, _, arg = v.partition("=")
    if name in ("priced", "norescue"):
        variants[v] = SpecConfig(proposers=P, max_draft_tokens=int(arg or 24))
    elif name == "fixed":
        p, k = arg.split("/")
        variants[v] = SpecConfig(proposers=P, max_draft_tokens=int(k), min_draft_prob=float(p))
engines = {k: Engine(policy, EngineConfig(max_batch_size=64, max_model_len=1024, device="cpu", spec=s)) for k, s in variants.items()}
w0 = step_work(prompts, 8, 0, eos)
outs0 = engines["plain"].generate(w0["prompts"], w0["params"], seeds=w0["seeds"], groups=w0["groups"])
print(grpo_update(hf, tok, policy, {k: (e, None) for k, e in engines.items()}, w0, outs0, [p.answer for p in problems]), flush=True)
w1 = step_work(prompts, 8, 1, eos, previous=outs0)
log = {}
def hook(e, name):
    c = e.controller
    if c is None: return
    orig = c.observe_step
    def obs(fed, emitted, seconds, batched=0.0, **kw):
        log.setdefault(name, []).append((fed, kw.get("drafted", 0), kw.get("rows"), emitted, seconds, kw.get("policy")))
        return orig(fed, emitted, seconds, batched, **kw)
    c.observe_step = obs
    op = c.plan_step
    def plan_step(*a, **kw):
        plan = op(*a, **kw)
        if plan is not None:
            thr.setdefault(name, []).append((plan.threshold, plan.token_cost, plan.token_value, c.critical_share, plan.policy))
        return plan
    c.plan_step = plan_step
thr = {}
import dataclasses
for k, e in engines.items():
    if k.startswith("norescue"):
        c = e.controller; op0 = c.plan_step
        def ps(*a, _op=op0, **kw):
            plan = _op(*a, **kw)
            return None if plan is None else dataclasses.replace(plan, lookahead=())
        c.plan_step = ps
for k, e in engines.items(): hook(e, k)
res = {k: [] for k in engines}
ref = None
for rnd in range(int(sys.argv[2])):
    for k, e in engines.items():
        log.pop(k, None); thr.pop(k, None)
        t = time.perf_counter()
        o = e.generate(w1["prompts"], w1["params"], seeds=w1["seeds"], drafts=w1["drafts"], groups=w1["groups"], draft_logprobs=w1["draft_lps"])
        s = time.perf_counter() - t
        toks = [x.token_ids for x in o]
        ref = ref or toks
        assert toks == ref, k
        res[k].append(s)
        st = log.get(k, [])
        if st:
            fed = sum(x[0] for x in st); dr = sum(x[1] for x in st); em = sum(x[3] for x in st); sec = sum(x[4] for x in st)
            pol = {}
            for x in st: pol[x[5]] = pol.get(x[5], 0) + 1
            th = thr.get(k, [])
            if th:
                q = sorted(th)
                print("    threshold quartiles", [round(q[int(len(q)*f)][0], 3) for f in (0.1, 0.5, 0.9)], "cost/value/share med", [round(statistics.median(x[i] for x in th), 6) for i in (1, 2, 3)])
            print(f"  {k}: {s:.2f}s steps {e.last_run.steps} fed {fed} drafted {dr} emitted {em} fed/emitted {fed/em:.2f} step-sec {sec:.2f} policies {pol}", flush=True)
        else:
            print(f"  {k}: {s:.2f}s steps {e.last_run.steps}", flush=True)
print("load", os.getloadavg())
base = res["plain"]
for k, v in res.items():
    r = [b / x for b, x in zip(base, v)]
    print(f"{k:>16}: min {min(v):.2f} med {statistics.median(v):.2f}  speedup med {statistics.median(r):.2f} all {[round(x,2) for x in r]}")
