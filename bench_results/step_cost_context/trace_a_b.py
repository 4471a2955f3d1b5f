"""A vs B at step 1 from saved weights: per-step seconds for both (wrap Engine._step)."""
import json, sys, time, os
import torch
sys.path.insert(0, "/work/main")
from drafter.bench import demo_policy
import drafter.bench_engine as be
from rollout.model import CausalLM
from rollout import engine as E
hf, tok, folder, make_problems, TaskConfig = demo_policy()
policy = CausalLM.from_pretrained(folder, device="cpu")
be.CONFIGS = {k: v for k, v in be.CONFIGS.items() if k in ("A_plain", "B_default")}
engines = be.make_engines(policy, None)
STEP = int(os.environ.get("STEP", "1"))
if STEP == 1:
    sd = torch.load("/tmp/s41/policy_step1.pt")
    for eng, _ in engines.values():
        eng.update_weights(sd)
    w1 = torch.load("/tmp/s41/w1.pt", weights_only=False)["w1"]
else:
    task = TaskConfig(num_problems=64, seed=0)
    prompts = [tok(p.prompt)["input_ids"] for p in make_problems(task)]
    w1 = be.step_work(prompts, 8, 0, tok.eos_token_id)
trace = []
orig = E.Engine._step
def step(self, running):
    t = time.perf_counter()
    d = orig(self, running)
    trace.append((time.perf_counter() - t, d.policy, d.rows, d.fed, d.drafted, d.emitted, sum(r.num_tokens for r in running)))
    return d
E.Engine._step = step
out = {}
for rep in range(int(sys.argv[1])):
    for name in ("A_plain", "B_default"):
        trace.clear()
        res, outs = be.one_run(name, engines[name], w1)
        ctl = engines[name][0].controller
        if ctl is not None:
            print("   plane", [f"{x:.3g}" for x in ctl.cost.plane()], "plain plane", [f"{x:.3g}" for x in ctl.plain.cost.plane()],
                  {p: (round(l.ratio, 2), l.record_ratio and round(l.record_ratio, 2)) for p, l in ctl.plain.ledgers.items()})
        print(name, round(res["seconds"], 2), round(res["cpu_seconds"], 2), res["engine_steps"], round(res["tokens_per_forward"], 2), os.getloadavg(), flush=True)
        out[f"{name}_{rep}"] = list(trace)
json.dump(out, open(sys.argv[2], "w"))
