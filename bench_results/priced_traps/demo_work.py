"""What the scripts here share: the demo's policy and its step-0 or step-1 rollout work (64 prompts x
8 samples), the engines' configuration (batch 64, one thread), a run, and a trace line of the plain
reference's ledgers. Step 1's work is bench_results/cpu_ceiling/prof1.py's (/tmp/s44: the policy
after one GRPO update, and the work with step 0's responses as history)."""
import os
import pickle
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402

from drafter.bench import demo_policy  # noqa: E402
from drafter.bench_engine import step_work  # noqa: E402
from rollout import EngineConfig  # noqa: E402
from rollout.model import CausalLM  # noqa: E402

PROPOSERS = ("history", "suffix", "lookahead")
torch.set_num_threads(1)


def policy_and_work(step: int):
    hf, tok, folder, make_problems, TaskConfig = demo_policy()
    policy = CausalLM.from_pretrained(folder, device="cpu")
    if step == 1:
        policy.load_state_dict(torch.load("/tmp/s44/policy1.pt"))
        return policy, pickle.load(open("/tmp/s44/w1.pkl", "rb"))
    problems = make_problems(TaskConfig(num_problems=64, seed=0))
    return policy, step_work([tok(p.prompt)["input_ids"] for p in problems], 8, 0, tok.eos_token_id)


def config(spec) -> EngineConfig:
    return EngineConfig(max_batch_size=64, max_model_len=1024, max_num_batched_tokens=2048, device="cpu", spec=spec)


def generate(engine, work):
    return engine.generate(work["prompts"], work["params"], seeds=work["seeds"], drafts=work["drafts"],
                           groups=work["groups"], draft_logprobs=work["draft_lps"])


def ledgers(ref) -> str:
    return " ".join(f"{n}:off{x.off_left} r{x.ratio:.2f} rec{x.record_ratio or 0:.2f} w{x.wait}" for n, x in ref.ledgers.items())


def interleave(engines: dict, work, rounds: int, label: str = "") -> dict:
    """Each engine runs the work once a round, in turn; prints each run, returns its seconds by name."""
    times = {n: [] for n in engines}
    for r in range(rounds):
        for n, e in engines.items():
            t = time.perf_counter(); generate(e, work); dt = time.perf_counter() - t
            times[n].append(dt)
            print(*([label] if label else []), r, n, round(dt, 3), e.last_run, flush=True)
    return times
