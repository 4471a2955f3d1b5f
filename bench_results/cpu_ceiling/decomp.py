"""Demo step 0: per-step logs of plain and spec engines; a cost model fitted on plain's steps explains spec's."""
import sys, time, os
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import numpy as np, torch
from rollout import Engine, EngineConfig, SpecConfig
from rollout.model import CausalLM
from drafter.bench import demo_policy
from drafter.bench_engine import step_work
torch.set_num_threads(1)
hf, tok, folder, make_problems, TaskConfig = demo_policy()
policy = CausalLM.from_pretrained(folder, device="cpu")
problems = make_problems(TaskConfig(num_problems=64, seed=0))
prompts = [tok(p.prompt)["input_ids"] for p in problems]
eos = tok.eos_token_id
w0 = step_work(prompts, 8, 0, eos)
P = ("history", "suffix", "lookahead")
cfg = lambda s: EngineConfig(max_batch_size=64, max_model_len=1024, max_num_batched_tokens=2048, device="cpu", spec=s)
def instrument(e):
    log = []
    orig = e._step
    def step(running):
        dec = sum(1 for r in running if r.num_tokens - r.num_cached == 1)
        pending = sum(r.num_tokens - r.num_cached for r in running)
        att = sum((r.num_tokens - r.num_cached) * r.num_cached for r in running)
        t = time.perf_counter(); d = orig(running); s = time.perf_counter() - t
        log.append((dec, pending - dec, att, d.drafted, d.emitted, 0 if d.policy is None else 1, s)); return d
    e._step = step
    return log
for rnd in range(int(sys.argv[1])):
    plain, spec = Engine(policy, cfg(None)), Engine(policy, cfg(SpecConfig(proposers=P, max_draft_tokens=24)))
    lp, ls = instrument(plain), instrument(spec)
    tot = {}
    for name, e in ([("plain", plain), ("spec", spec)] if rnd % 2 == 0 else [("spec", spec), ("plain", plain)]):
        t = time.perf_counter(); e.generate(w0["prompts"], w0["params"], seeds=w0["seeds"], groups=w0["groups"]); tot[name] = time.perf_counter() - t
    a, b = np.array(lp), np.array(ls)
    X = lambda m: np.c_[np.ones(len(m)), m[:, 0], m[:, 1], m[:, 2]]
    coef, *_ = np.linalg.lstsq(X(a), a[:, 6], rcond=None)
    off, on = b[b[:, 5] == 0], b[b[:, 5] == 1]
    pred_off = X(off) @ coef
    # what spec's emitted tokens would cost as plain steps: the model over the plain engine's own steps is its total
    print(f"round {rnd}: plain {tot['plain']:.2f}s ({len(a)} steps, model resid {a[:,6].sum() - (X(a)@coef).sum():+.2f}) spec {tot['spec']:.2f}s ({tot['plain']/tot['spec']:.3f}x) | "
          f"off {len(off)} steps actual {off[:,6].sum():.2f} model {pred_off.sum():.2f} | on {len(on)} steps actual {on[:,6].sum():.2f}, "
          f"decode rows {int(on[:,0].sum())} drafted {int(on[:,3].sum())} emitted {int(on[:,4].sum())}, model as plain-at-same-rows {(X(on)@coef).sum():.2f} | "
          f"coef ms {np.round(coef*1e3, 5).tolist()} load {os.getloadavg()[0]:.2f}", flush=True)
