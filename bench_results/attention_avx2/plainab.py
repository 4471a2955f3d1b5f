"""One tree's engines (A plain, B default, C drafter, D default+drafter) on step-0 work: times per config."""
import sys, time, json, torch
from rollout import Engine, EngineConfig, SpecConfig
from rollout.model import CausalLM
from rl_integration.config import RunConfig
from rl_integration.demo.policy import load_or_warm_start_drafter
from drafter.bench import demo_policy
from drafter.export import load
from drafter.bench_engine import step_work, DEFAULT
from drafter.proposer import DrafterProposer
torch.set_num_threads(1)
hf, tok, folder, make_problems, TaskConfig = demo_policy()
policy = CausalLM.from_pretrained(folder, device="cpu")
d = RunConfig().rollout.drafter
head = load(load_or_warm_start_drafter(folder, RunConfig().task.embedded, d.kind, d.warm_start_s, window=d.window, layer=d.shape()), policy, dtype=torch.float32)
nprob, batch = int(sys.argv[1]), int(sys.argv[2])
prompts = [tok(p.prompt)["input_ids"] for p in make_problems(TaskConfig(num_problems=nprob, seed=0))]
SETS = {"A": None, "B": DEFAULT, "C": ("drafter",), "D": DEFAULT + ("drafter",)}
out = {}
w0 = step_work(prompts, 8, 0, tok.eos_token_id)
for name in sys.argv[3].split(","):
    props = SETS[name[0]]
    spec = None if props is None else SpecConfig(proposers=props, max_draft_tokens=24, min_draft_prob=0.3 if "fix" in name else None)
    eng = Engine(policy, EngineConfig(max_batch_size=batch, max_model_len=1024, spec=spec, device="cpu"))
    dp = DrafterProposer.of(eng)
    if dp is not None:
        dp.set_head(head, 1)
    eng.generate(w0["prompts"][:8], w0["params"], seeds=w0["seeds"][:8])
    t = time.perf_counter()
    outs = eng.generate(w0["prompts"], w0["params"], seeds=w0["seeds"], groups=w0["groups"])
    out[name] = {"s": time.perf_counter() - t, "steps": eng.last_run.steps, "h": hash(tuple(tuple(o.token_ids) for o in outs))}
print("RESULT", json.dumps(out))
