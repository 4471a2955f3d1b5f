"""The demo's step-0 and step-1 rollout work (64 prompts x 8 samples, batch 64; step 1 after one
GRPO update, with step 0's responses as history), the priced budget with this session's two
changes (new) and without them (old: the proposers' asks and observes counted in the step-cost
fit, and a switched-off policy's wait held whatever the load), beside plain and fixed lengths,
interleaved in one process: python ab.py ROUNDS [OUT.json]"""
import json, os, statistics, sys, time
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
from rollout import Engine, EngineConfig, SpecConfig
from rollout.model import CausalLM
from drafter.bench import demo_policy
from drafter.bench_engine import grpo_update, step_work

torch.set_num_threads(1)
hf, tok, folder, make_problems, TaskConfig = demo_policy()
policy = CausalLM.from_pretrained(folder, device="cpu")
problems = make_problems(TaskConfig(num_problems=64, seed=0))
prompts = [tok(p.prompt)["input_ids"] for p in problems]
eos = tok.eos_token_id
P = ("history", "suffix", "lookahead")
cfg = lambda s: EngineConfig(max_batch_size=64, max_model_len=1024, max_num_batched_tokens=2048, device="cpu", spec=s)


def old(engine):
    """The engine's controller as before this session's changes (instance-level patches)."""
    c = engine.controller
    observe_step, choose = c.observe_step, c.plain.choose

    def observe_step_old(*a, observed=0.0, **k):
        c.asked = 0.0  # (asks counted in the fit, as before)
        return observe_step(*a, **k)

    c.observe_step = observe_step_old
    c.plain.choose = lambda eager_ok=False, running=0: choose(eager_ok)
    return engine


def engines():
    e = {"plain": Engine(policy, cfg(None)), "plain again": Engine(policy, cfg(None))}
    for k in (24, 4):
        e[f"new priced k{k}"] = Engine(policy, cfg(SpecConfig(proposers=P, max_draft_tokens=k)))
        e[f"old priced k{k}"] = old(Engine(policy, cfg(SpecConfig(proposers=P, max_draft_tokens=k))))
    for k in (4, 8):
        e[f"fixed {k}"] = Engine(policy, cfg(SpecConfig(proposers=P, max_draft_tokens=k, min_draft_prob=0.0)))
    return e


def measure(work, rounds):
    es = engines()
    go = lambda e: e.generate(work["prompts"], work["params"], seeds=work["seeds"], drafts=work["drafts"],
                              groups=work["groups"], draft_logprobs=work["draft_lps"])
    times, ref = {n: [] for n in es}, None
    for r in range(rounds):
        for n, e in es.items():
            t = time.perf_counter(); out = go(e); dt = time.perf_counter() - t
            toks = [o.token_ids for o in out]
            ref = ref or toks
            assert toks == ref, f"{n}: tokens differ"
            times[n].append(dt)
            print(r, n, round(dt, 3), e.last_run, flush=True)
    rows = {n: {"median_s": statistics.median(v), "min_s": min(v),
                "over_plain": statistics.median(a / b for a, b in zip(v, times["plain"]))} for n, v in times.items()}
    for n, x in rows.items():
        print(f"  {n:16s} median {x['median_s']:.3f}s min {x['min_s']:.3f}s  over plain (median of ratios) {x['over_plain']:.3f}")
    return {"seconds": times, "summary": rows}


rounds = int(sys.argv[1])
load = {"before": os.getloadavg()}
plain = Engine(policy, cfg(None))
w0 = step_work(prompts, 8, 0, eos)
o0 = plain.generate(w0["prompts"], w0["params"], seeds=w0["seeds"], groups=w0["groups"])
print("step 0 work (no history)")
res = {"step0": measure(w0, rounds)}
grpo_update(hf, tok, policy, {"p": (plain, None)}, w0, o0, [p.answer for p in problems])
w1 = step_work(prompts, 8, 1, eos, previous=o0)
print("step 1 work (history from step 0, after one GRPO update)")
res["step1"] = measure(w1, rounds)
load["after"] = os.getloadavg()
res["load_average"] = load
print("load average", load)
if len(sys.argv) > 2:
    json.dump(res, open(sys.argv[2], "w"), indent=1)
