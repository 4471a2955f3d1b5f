"""The drafter in the engine on the demo: four engines on the same prompts, seeds and weights.

    python -m benchmarks.bench_drafter [--prompts 64] [--samples 8] [--reps 2] [--train-seconds 5] [--layer 128:2:1]
                            [--out bench_results/drafter_engine.json]

A plain engine, B today's default proposers (history, suffix, lookahead), C the drafter alone,
D the default proposers and the drafter, each run `reps` times interleaved (A B C D A B C D ...)
at step 0 (the demo policy and its cached warm-started head), then after one GRPO update of the
policy on step 0's samples and the head trained between steps on D's buffer (features refreshed
under the new weights, within --train-seconds), at step 1 (history drafts from step 0). Per
engine: rollout seconds (min, median), engine steps, tokens per forward, per proposer proposed /
accepted; for the drafter its per-token acceptance (accepted / compared), its share of the
rollout's time and its position cost; for D the tokens per forward of the steps where history
and suffix offered nothing, on well-formed responses. For C, every draft of the fixed head is
compared with the exact simulation (drafter/simulate.py) of the same chain. Tokens are checked
identical across the four. The demo's modules are imported here only (rl_integration sits
above drafter).
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Optional

import torch

from drafter.features import SavedRollout
from drafter.online import OnlineConfig, OnlineState, train_on_buffer
from drafter.proposer import DrafterProposer
from drafter.simulate import chain_runs, simulated_acceptance, summarize
from rollout import Engine, EngineConfig, SamplingParams, SpecConfig
from rollout.core import threads
from rollout.core.seeds import prompt_key, sample_seed

DEFAULT = ("history", "suffix", "lookahead")
CONFIGS = {"A_plain": None, "B_default": DEFAULT, "C_drafter": ("drafter",),
           "D_default_drafter": DEFAULT + ("drafter",)}


def make_engines(policy, head, min_draft_prob: Optional[float] = None) -> dict:
    """name -> (Engine, its Recorder): the demo's engine settings, one speculation set each, on
    the policy's device; min_draft_prob: a fixed threshold instead of the priced budget (what the
    drafts can do whatever this machine's step costs)."""
    engines = {}
    device = str(policy.lm_head.weight.device)
    for name, proposers in CONFIGS.items():
        spec = None if proposers is None else SpecConfig(proposers=proposers, max_draft_tokens=24,
                                                         min_draft_prob=min_draft_prob)
        eng = Engine(policy, EngineConfig(max_batch_size=64, max_model_len=1024, spec=spec, device=device))
        dp = DrafterProposer.of(eng)
        if dp is not None:
            dp.set_head(head, 1)
        engines[name] = (eng, Recorder(eng))
    return engines


class Recorder:
    """Per (request, response position) of each verify step of an engine: whether history or
    suffix offered a draft, and every drafter draft with its accepted count."""

    def __init__(self, engine: Engine):
        self.reset()
        names = {p.name: p for p in engine.proposers}
        ctl = engine.budget
        if ctl is None:
            return
        choose = ctl.choose

        def wrapped_choose(requests, rooms, plan):
            for req, room in zip(requests, rooms):
                if room > 0:
                    self.steps.setdefault((req.index, len(req.output_ids)), False)
            return choose(requests, rooms, plan)

        ctl.choose = wrapped_choose
        for name in ("history", "suffix"):
            if name in names:
                self._watch(names[name])
        if "drafter" in names:
            dp, on_step = names["drafter"], names["drafter"].on_step

            def record(result):
                for req, draft, accepted, emitted, _, _ in result.rows:
                    if draft is not None and draft.proposer is dp:
                        self.drafts.append((req.index, len(req.output_ids) - len(emitted) - 1, len(draft.tokens),
                                            accepted))
                return on_step(result)

            dp.on_step = record

    def reset(self) -> None:
        self.steps: dict = {}  # (index, position) -> copy offered
        self.drafts: list = []  # (index, pending position, k, accepted)

    def _watch(self, proposer) -> None:
        propose = proposer.propose

        def wrapped(requests, k):
            drafts = propose(requests, k)
            for req, d in zip(requests, drafts):
                if d is not None and d.tokens:
                    self.steps[(req.index, len(req.output_ids))] = True
            return drafts

        proposer.propose = wrapped

    def no_copy(self, outs, well_formed) -> dict:
        """Tokens per forward over the steps where neither history nor suffix offered a draft."""
        by_req: dict = {}
        for (i, pos), copied in self.steps.items():
            by_req.setdefault(i, []).append((pos, copied))
        tokens = forwards = 0
        for i, steps in by_req.items():
            if not well_formed[i]:
                continue
            steps.sort()
            ends = [p for p, _ in steps[1:]] + [len(outs[i].token_ids)]
            for (pos, copied), end in zip(steps, ends):
                if not copied:
                    tokens, forwards = tokens + end - pos, forwards + 1
        return {"no_copy_steps": forwards, "no_copy_tokens": tokens,
                "no_copy_tokens_per_forward": tokens / forwards if forwards else None}


def one_run(name: str, engine: tuple, work: dict, well_formed=None) -> tuple[dict, list]:
    eng, rec = engine
    dp = DrafterProposer.of(eng)
    before = dict(dp.stats) if dp is not None else {}
    rec.reset()
    start, cpu = time.perf_counter(), time.process_time()
    outs = eng.generate(work["prompts"], work["params"], seeds=work["seeds"], drafts=work["drafts"],
                        groups=work["groups"], draft_logprobs=work["draft_lps"])
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(len(o.token_ids) for o in outs)
    run = eng.last_run
    proposed, accepted = {}, {}
    for o in outs:
        for k, v in o.stats["proposed"].items():
            proposed[k] = proposed.get(k, 0) + v
        for k, v in o.stats["accepted"].items():
            accepted[k] = accepted.get(k, 0) + v
    res = {"seconds": seconds, "cpu_seconds": cpu, "engine_steps": run.steps, "generated_tokens": tokens,
           "tokens_per_forward": tokens / (sum(o.stats["forward_passes"] for o in outs) + len(outs)),
           "proposed": proposed, "accepted": accepted}
    if dp is not None:
        d = {k: dp.stats[k] - before.get(k, 0) for k in dp.stats}
        res["drafter"] = {**d, "share_of_rollout": d["seconds"] / seconds,
                          "per_token_acceptance": accepted.get("drafter", 0) / max(1, d["compared"]),
                          "accepted_fraction": accepted.get("drafter", 0) / max(1, proposed.get("drafter", 0)),
                          "seconds_per_position": d["seconds"] / max(1, d["positions"]),
                          "engine_seconds_per_step": (seconds - d["seconds"]) / max(1, run.steps)}
    if well_formed is not None and name.startswith("D"):
        res.update(rec.no_copy(outs, well_formed))
    return res, outs


def step_work(prompts, samples: int, step: int, eos: int, previous: Optional[list] = None) -> dict:
    ids, seeds, groups = [], [], []
    for g, p in enumerate(prompts):
        for s in range(samples):
            ids.append(p)
            seeds.append(sample_seed(0, prompt_key(p), s, step))  # RolloutClient's seeds at trainer.seed 0
            groups.append(g)
    params = SamplingParams(temperature=1.0, max_tokens=512, stop_token_ids=[eos])
    return {"prompts": ids, "params": params, "seeds": seeds, "groups": groups,
            "drafts": None if previous is None else [o.token_ids for o in previous],
            "draft_lps": None if previous is None else [o.logprobs for o in previous]}


def run_step(engines: dict, work: dict, reps: int, well_formed_fn) -> tuple[dict, dict]:
    results = {name: [] for name in engines}
    outs_by = {}
    for _ in range(reps):
        for name, eng in engines.items():
            res, outs = one_run(name, eng, work, None)
            if name not in outs_by:
                outs_by[name] = outs
            results[name].append(res)
    ref = [o.token_ids for o in outs_by["A_plain"]]  # (A's outputs are the reference)
    identical = all([o.token_ids for o in outs] == ref for outs in outs_by.values())
    well_formed = well_formed_fn(outs_by["A_plain"])
    d_res, _ = one_run("D_default_drafter", engines["D_default_drafter"], work, well_formed)  # for its no-copy steps
    summary = {name: summarize_runs(rs) for name, rs in results.items()}
    summary["D_default_drafter"].update({k: d_res[k] for k in d_res if k.startswith("no_copy")})
    summary["tokens_identical"] = identical
    return summary, outs_by


def summarize_runs(runs: list) -> dict:
    secs, cpu = [r["seconds"] for r in runs], [r["cpu_seconds"] for r in runs]
    out = {k: v for k, v in runs[-1].items() if k not in ("seconds", "cpu_seconds", "drafts")}
    out.update(seconds_min=min(secs), seconds_median=statistics.median(secs), seconds=secs,
               cpu_seconds_min=min(cpu), cpu_seconds_median=statistics.median(cpu), cpu_seconds=cpu)
    return out


def check_simulation(engine: tuple, work: dict, policy, head) -> dict:
    """A run of C with every drafter draft compared with the simulated run of the same chain
    (drafter/simulate.py, on the run's own outputs): accepted must be min(run, k) every time.
    Per-token acceptance over the engine's drafts, and the simulation's over every start."""
    eng, rec = engine
    rec.reset()
    outs = eng.generate(work["prompts"], work["params"], seeds=work["seeds"], groups=work["groups"])
    p = work["params"]
    saved = [SavedRollout(pr, o.token_ids, s, p.temperature, p.top_k, p.top_p)
             for pr, o, s in zip(work["prompts"], outs, work["seeds"])]
    runs = chain_runs(head, policy, saved, max_k=24)
    bad = sum(1 for i, t, k, a in rec.drafts if min(runs[i][t][0], k) != a)
    accepted = sum(a for *_, a in rec.drafts)
    compared = accepted + sum(1 for i, t, k, a in rec.drafts if a < min(k, runs[i][t][1]))
    return {"drafts": len(rec.drafts), "mismatched_drafts": bad, "engine_per_token": accepted / max(1, compared),
            "simulated_per_token_every_start_k8": summarize(runs, 8)["per_token_acceptance"]}


def grpo_update(hf, tok, policy, engines: dict, work: dict, outs, answers: list) -> dict:
    """One GRPO step (the demo's trainer settings) on step 0's samples; the engines get the weights."""
    from rl_integration.config import TrainerSection
    from rl_integration.demo.task import reward_fn
    from rl_integration.grpo import GRPOTrainer
    from rl_integration.rollout_client import RolloutBatch

    n = len(outs) // len(answers)
    rewards = [reward_fn(tok.decode(o.token_ids, skip_special_tokens=True), answers[g])
               for o, g in zip(outs, work["groups"])]
    batch = RolloutBatch(prompt_ids=work["prompts"], completion_ids=[o.token_ids for o in outs],
                         logprobs=[o.logprobs for o in outs], seeds=work["seeds"], group_index=work["groups"],
                         sample_index=[i % n for i in range(len(outs))], finish_reasons=[o.finish_reason for o in outs],
                         sample_stats=[o.stats for o in outs], step_stats={}, step=0, n=n)
    stats = GRPOTrainer(hf, TrainerSection(), 1.0, 0, 1.0, tok.pad_token_id).step(batch, rewards)
    sd = {k: v.detach() for k, v in hf.state_dict().items()}
    for eng, _ in engines.values():
        eng.update_weights(sd)
    return {"reward_mean": sum(rewards) / len(rewards), "train_seconds": stats["train_seconds"]}


def engine_bench(args) -> dict:
    from benchmarks.bench_drafter import demo_policy, parse_shapes, time_steps
    from drafter.export import load
    from rl_integration.config import RunConfig
    from rl_integration.demo.policy import load_or_warm_start_drafter
    from rl_integration.demo.task import extract_answer
    from rollout.core.model import CausalLM

    t0 = time.perf_counter()
    hf, tok, folder, make_problems, TaskConfig = demo_policy()
    task = TaskConfig(num_problems=args.prompts, seed=0)
    policy = CausalLM.from_pretrained(folder, device=args.device)
    d = RunConfig().rollout.drafter  # the demo's drafter: its warm start, cached beside the policy
    layer = parse_shapes(args.layer, args)[0] if args.layer else d.layer()
    head = load(load_or_warm_start_drafter(folder, RunConfig().task.embedded, d.kind, d.warm_start_s, window=d.window,
                                           layer=layer), policy, dtype=torch.float32)
    problems = make_problems(task)
    prompts = [tok(p.prompt)["input_ids"] for p in problems]
    eos = tok.eos_token_id

    def well_formed(outs):
        return [o.finish_reason == "stop" and extract_answer(tok.decode(o.token_ids, skip_special_tokens=True))
                is not None for o in outs]

    engines = make_engines(policy, head, args.min_draft_prob)
    result = {"policy": folder, "device": args.device, "prompts": args.prompts, "samples": args.samples,
              "reps": args.reps,
              "min_draft_prob": args.min_draft_prob,
              "head": {"parameters": head.num_parameters(), **layer}}
    w0 = step_work(prompts, args.samples, 0, eos)
    result["step0"], outs0 = run_step(engines, w0, args.reps, well_formed)
    result["step0"]["simulation_check"] = check_simulation(engines["C_drafter"], w0, policy, head)
    result["update"] = grpo_update(hf, tok, policy, engines, w0, outs0["A_plain"], [p.answer for p in problems])
    dp = DrafterProposer.of(engines["D_default_drafter"][0])
    online = OnlineConfig(d, num_threads=threads.trainer_threads(None))  # the head exists: d's training keys
    train = train_on_buffer(dp, OnlineState(), online, args.train_seconds)
    result["between_steps_training"] = train
    DrafterProposer.of(engines["C_drafter"][0]).set_head(dp.head, dp.head_version)
    w1 = step_work(prompts, args.samples, 1, eos, previous=outs0["A_plain"])
    result["step1"], outs1 = run_step(engines, w1, args.reps, well_formed)
    p = w1["params"]
    saved1 = [SavedRollout(pr, o.token_ids, s, p.temperature, p.top_k, p.top_p)
              for pr, o, s in zip(w1["prompts"], outs1["A_plain"], w1["seeds"])]
    result["step1"]["simulated_acceptance_next_step"] = simulated_acceptance(dp.head, policy, saved1, 8)
    w1_plain = dict(w1, drafts=None, draft_lps=None)
    result["step1"]["simulation_check"] = check_simulation(engines["C_drafter"], w1_plain, policy, dp.head)
    result["head_cost"] = time_steps(policy, dp.head, 64, args.ctx, args.reps_cost)
    result.update(total_seconds=time.perf_counter() - t0, loadavg=os.getloadavg(),
                  note="shared 2-core machine; the four engines measured interleaved in one process")
    return result


def ratios(result: dict) -> list[str]:
    lines = [f"load average {result['loadavg']}"]
    for ep in ("step0", "step1"):
        r = result[ep]
        b, d = r["B_default"], r["D_default_drafter"]
        lines.append(f"{ep}: identical={r['tokens_identical']}  " + "  ".join(
            f"{n[0]} {r[n]['seconds_min']:.1f}s/{r[n]['engine_steps']} steps/{r[n]['tokens_per_forward']:.2f} tok/fwd"
            for n in CONFIGS))
        lines.append(f"{ep}: D vs B {b['seconds_min'] / d['seconds_min']:.2f}x (min), "
                     f"{statistics.median(b['seconds']) / statistics.median(d['seconds']):.2f}x (median); "
                     f"CPU s {b['cpu_seconds_min'] / d['cpu_seconds_min']:.2f}x (min), "
                     f"{b['cpu_seconds_median'] / d['cpu_seconds_median']:.2f}x (median); "
                     f"D vs A {r['A_plain']['seconds_min'] / d['seconds_min']:.2f}x; drafter in D: per-token "
                     f"{d['drafter']['per_token_acceptance']:.3f}, share {d['drafter']['share_of_rollout']:.2f}; "
                     f"in C: per-token {r['C_drafter']['drafter']['per_token_acceptance']:.3f}; no-copy tok/fwd "
                     f"{d.get('no_copy_tokens_per_forward')}; sim check {r['simulation_check']}")
    sim = result["step1"]["simulated_acceptance_next_step"]
    lines.append(f"simulated acceptance on step 1's rollout: {sim['per_token_acceptance']:.3f}; drafter training "
                 f"between steps {result['between_steps_training']['drafter_train_seconds']:.1f}s "
                 f"({result['between_steps_training']['drafter_train_steps']} steps); head position / engine "
                 f"decode step at batch 64: first {result['head_cost']['ratio_median']:.3f} (median), "
                 f"{result['head_cost']['ratio_min']:.3f} (min); within an 8-token chain "
                 f"{result['head_cost']['position_in_chain_ratio_median']:.3f} (median), "
                 f"{result['head_cost']['position_in_chain_ratio_min']:.3f} (min)")
    return lines
