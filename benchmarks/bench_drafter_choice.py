"""Which proposer's drafts win, with and without the drafter: engines B (history, suffix,
lookahead) and D (the same and the drafter) of benchmarks/bench_drafter_engine.py, at step 0 and at step 1.

    python -m benchmarks.bench_drafter --choice [--prompts 64] [--samples 8] [--train-seconds-between 5]
                                     [--min-draft-prob P] [--out bench_results/drafter_choice.json]

Every `choose` of the draft budget is watched: for each proposer, the draft it would give and that
draft's cut (tokens granted, expected accepted run) exactly as `choose` computes them, whether
`choose` asked it or skipped it; then which draft won. Per engine and step: per proposer how often
it offered a granted draft, how often it won, whom it lost to and by how much expected run, its
tokens proposed / accepted, and the budget's learnt rate and the plan's floor. It answers
whether the drafter crowds out copy drafts (D's history drafts losing to worse head drafts) or
whether the copies' drafts are cut differently (the threshold, the learnt rates). Same flow as
the engine bench: step 0, one GRPO update, the head trained between steps on D's buffer, step 1.
The loser's accepted run is exact although it was never verified: the tokens are the same
whoever drafts, so a draft's run is its common prefix with the output. --min-draft-prob fixes
the budget's floor (drafts then do not depend on timings: the run is reproducible).
"""
from __future__ import annotations

import os
import statistics
import time
from collections import defaultdict

import torch

from benchmarks.bench_drafter_engine import DEFAULT, grpo_update, one_run, step_work
from drafter.online import OnlineConfig, OnlineState, train_on_buffer
from drafter.proposer import DrafterProposer
from rollout import Engine, EngineConfig, SpecConfig
from rollout.core import threads

ENGINES = {"B_default": DEFAULT, "D_default_drafter": DEFAULT + ("drafter",)}


class ChoiceLog:
    """Tallies of one engine's `choose` calls (wrapped in place; the wrapper asks each proposer
    once more, which changes no draft: their `propose` only reads, suffix's catches its index up)."""

    def __init__(self, engine: Engine):
        self.reset()
        ctl = engine.budget
        choose, plan_step = ctl.choose, ctl.plan_step

        def watched_plan(*a, **kw):
            plan = plan_step(*a, **kw)
            if plan is not None:
                self.thresholds.append(plan.floor)
                for o in plan.offers:
                    self.tops[o.proposer.name].append(o.top)
            return plan

        def watched_choose(requests, rooms, plan):
            chosen = choose(requests, rooms, plan)
            for req, room, c in zip(requests, rooms, chosen):  # (after: the log's own asking moves nothing)
                if room > 0:
                    self._offers(req, room, plan)
                    self._won(c[0] if c is not None else None)
            return chosen

        ctl.plan_step, ctl.choose = watched_plan, watched_choose

    def reset(self) -> None:
        self.thresholds, self.tops = [], defaultdict(list)
        self.offered, self.won, self.chooses = defaultdict(int), defaultdict(int), 0
        self.lost_to = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))  # loser -> winner -> [count, value lost]
        self._pending: dict = {}
        self.duels: list = []  # ((request, position), loser, its draft, winner, its draft)

    def _offers(self, req, room: int, plan) -> None:
        self.chooses += 1
        values = {}
        for o in plan.offers:
            cap = min(o.most, room)
            draft = o.proposer.propose([req], cap)[0] if cap > 0 else None
            if draft is None or not draft.tokens:
                continue
            n, value, _ = plan.judge(o, draft, min(cap, len(draft.tokens)))
            if n > 0:
                values[o.proposer.name] = (value, list(draft.tokens[:n]))
                self.offered[o.proposer.name] += 1
        self._pending = values
        self._at = (req.index, len(req.output_ids))

    def _won(self, chosen) -> None:
        winner = chosen.proposer.name if chosen is not None else None
        if winner is not None:
            self.won[winner] += 1
        won_value = self._pending.get(winner, (0.0, []))[0]
        for name, (value, tokens) in self._pending.items():
            if name != winner:
                entry = self.lost_to[name][winner or "none"]
                entry[0] += 1
                entry[1] += value - won_value
                if chosen is not None:
                    self.duels.append((self._at, name, tokens, winner, list(chosen.tokens)))

    def realized(self, outs) -> dict:
        """Per (loser, winner): the accepted runs the two drafts had against the output (tokens
        are the same whoever drafts, so the loser's run is exact too): means, and how often and
        by how many tokens in all the loser would have done better."""
        agg = defaultdict(lambda: [0, 0, 0, 0, 0])  # count, winner run, loser run, loser better, tokens lost
        for (i, pos), loser, lt, winner, wt in self.duels:
            truth = outs[i].token_ids[pos:]
            runs = [next((j for j, (a, b) in enumerate(zip(d, truth)) if a != b), min(len(d), len(truth)))
                    for d in (wt, lt)]
            a = agg[(loser, winner)]
            a[0] += 1
            a[1] += runs[0]
            a[2] += runs[1]
            a[3] += runs[1] > runs[0]
            a[4] += max(0, runs[1] - runs[0])
        return {f"{lo}<{w}": {"count": c, "winner_run_mean": wr / c, "loser_run_mean": lr / c,
                              "loser_better": b, "tokens_lost": t}
                for (lo, w), (c, wr, lr, b, t) in agg.items()}

    def summary(self) -> dict:
        return {"chooses": self.chooses, "offered": dict(self.offered), "won": dict(self.won),
                "lost_to": {n: {w: {"count": c, "mean_value_gap": v / c} for w, (c, v) in d.items()}
                            for n, d in self.lost_to.items()},
                "threshold_median": statistics.median(self.thresholds) if self.thresholds else None,
                "top_rate_median": {n: statistics.median(v) for n, v in self.tops.items()}}


class _NoRecorder:
    def reset(self) -> None:
        pass


def run(engines: dict, logs: dict, work: dict) -> tuple[dict, list]:
    out, outs = {}, None
    for name, eng in engines.items():
        logs[name].reset()
        res, outs = one_run(name, (eng, _NoRecorder()), work)
        out[name] = {k: res[k] for k in ("seconds", "engine_steps", "tokens_per_forward", "proposed", "accepted")}
        out[name]["choices"] = {**logs[name].summary(), "realized": logs[name].realized(outs)}
    return out, outs


def choice_bench(args) -> dict:
    from benchmarks.bench_drafter import demo_policy
    from drafter.export import load
    from rl_integration.config import RunConfig
    from rl_integration.demo.policy import load_or_warm_start_drafter
    from rollout.core.model import CausalLM

    t0 = time.perf_counter()
    hf, tok, folder, make_problems, TaskConfig = demo_policy()
    policy = CausalLM.from_pretrained(folder)
    d = RunConfig().rollout.drafter
    head = load(load_or_warm_start_drafter(folder, RunConfig().task.embedded, d.kind, d.warm_start_s, window=d.window,
                                           layer=d.layer()), policy, dtype=torch.float32)
    problems = make_problems(TaskConfig(num_problems=args.prompts, seed=0))
    prompts = [tok(p.prompt)["input_ids"] for p in problems]
    engines, logs = {}, {}
    for name, proposers in ENGINES.items():
        eng = Engine(policy, EngineConfig(max_batch_size=64, max_model_len=1024,
                                          spec=SpecConfig(proposers=proposers, max_draft_tokens=24,
                                                          min_draft_prob=args.min_draft_prob)))
        if DrafterProposer.of(eng) is not None:
            DrafterProposer.of(eng).set_head(head, 1)
        engines[name], logs[name] = eng, ChoiceLog(eng)
    result = {"prompts": args.prompts, "samples": args.samples, "min_draft_prob": args.min_draft_prob}
    w0 = step_work(prompts, args.samples, 0, tok.eos_token_id)
    result["step0"], outs0 = run(engines, logs, w0)
    result["update"] = grpo_update(hf, tok, policy, {n: (e, None) for n, e in engines.items()}, w0, outs0,
                                   [p.answer for p in problems])
    dp = DrafterProposer.of(engines["D_default_drafter"])
    online = OnlineConfig(d, num_threads=threads.trainer_threads(None))
    result["between_steps_training"] = train_on_buffer(dp, OnlineState(), online, args.train_seconds)
    w1 = step_work(prompts, args.samples, 1, tok.eos_token_id, previous=outs0)
    result["step1"], _ = run(engines, logs, w1)
    result.update(total_seconds=time.perf_counter() - t0, loadavg=os.getloadavg(),
                  note="shared 2-core machine; B and D in one process, one run each per step")
    return result


def choice_lines(result: dict) -> list[str]:
    lines = [f"load average {result['loadavg']}"]
    for step in ("step0", "step1"):
        for name, r in result[step].items():
            c = r["choices"]
            lines.append(f"{step} {name}: {r['engine_steps']} steps, {r['tokens_per_forward']:.2f} tok/fwd, "
                         f"threshold {c['threshold_median']:.3f}; proposed {r['proposed']} accepted {r['accepted']}")
            lines.append(f"    offered {c['offered']} won {c['won']} top rates "
                         + ", ".join(f"{n} {v:.3f}" for n, v in c["top_rate_median"].items()))
            for duel, v in c["realized"].items():
                loser, winner = duel.split("<")
                gap = c["lost_to"][loser][winner]["mean_value_gap"]
                lines.append(f"    {duel}: {v['count']}x, expected gap {gap:.2f}; accepted run winner "
                             f"{v['winner_run_mean']:.2f} vs loser {v['loser_run_mean']:.2f}; loser better "
                             f"{v['loser_better']}x, {v['tokens_lost']} tokens lost")
    return lines
