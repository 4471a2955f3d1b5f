"""Does speculation pay? The priced budget against plain decoding and fixed draft lengths
(`python -m benchmarks.bench --spec`).

Workloads span the acceptance a rollout meets, on a model big enough that a CPU forward is
mostly compute (so a draft token costs about what a request's token does):
    zero     a random model; copies and n-gram guesses never land
    low      a peaked model (a near-Markov chain, see `peaked_llama`): about 15% of drafts land
    medium   more peaked: about 40%
    high     most peaked: about 75%
Every workload drafts from history (an earlier sampling of the same prompts, other seeds: fresh
noise), siblings (groups of 4), lookahead (but zero) and n-grams. Configurations, same prompts and seeds:
plain (no speculation: fixed length 0), a second plain engine (an A/A pair: how far two runs of
the same thing read apart on this machine), priced (the default budget) and fixed draft lengths
2, 4, 8, 16 (every token drafted). Rounds are interleaved, the configurations in a shuffled
order each round; tokens must be identical across all of them. Prints, per workload and batch size, median
seconds, the priced budget's time against plain and against the best fixed length, and the A/A
pair's (each the median over rounds of the ratio within a round), and writes JSON.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import time

import torch

from rollout import Engine, EngineConfig, SamplingParams, SpecConfig
from rollout.config import torch_dtype
from rollout.core.model import CausalLM

from .bench import save_report

WORKLOADS = {"zero": (None, 1.0), "low": (10.0, 1.0), "medium": (14.0, 1.0), "high": (16.0, 1.0)}  # (peak, T)
FIXED = (2, 4, 8, 16)
PROPOSERS = ("history", "suffix", "lookahead", "ngram")
# A random model's logits hardly depend on the context, so the target's own samples past a
# rejection (lookahead) are drawn with the same coupled noise and land: leave them out there.
ZERO_PROPOSERS = ("history", "suffix", "ngram")
GROUP = 4


def peaked_llama(vocab: int, hidden: int, layers: int, peak, seed: int = 0):
    """A random Llama; with `peak`, nearly a Markov chain over a fixed permutation of the vocabulary
    (lm_head aligned with the permuted embeddings, the layers' residual writes damped so the
    embedding decides), whose top token has logit `peak` over the rest: the larger, the more its
    samples repeat. The forward costs what a random model's does."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                                   max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    if peak is not None:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(0.05)
                layer.mlp.down_proj.weight.mul_(0.05)
            emb = model.model.embed_tokens.weight
            rows = emb[torch.argsort(torch.randperm(vocab, generator=torch.Generator().manual_seed(seed + 1)))]
            model.lm_head.weight.copy_(peak * rows / (rows.norm(dim=1, keepdim=True) * hidden ** 0.5))
    return model


def configs(k_max: int, proposers: tuple) -> dict:
    out = {"plain": None, "plain again": None, "priced": SpecConfig(proposers=proposers, max_draft_tokens=k_max)}
    for k in FIXED:
        out[f"fixed {k}"] = SpecConfig(proposers=proposers, max_draft_tokens=k, min_draft_prob=0.0)
    return out


def prepare(name: str, batch: int, args) -> dict:
    """The workload's engines, prompts, seeds and history drafts (sampled once, other seeds)."""
    peak, temperature = WORKLOADS[name]
    model = peaked_llama(args.vocab, args.hidden, args.layers, peak)
    n_prompts = max(1, max(2 * batch, 8) // GROUP)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, args.vocab, (int(torch.randint(8, 24, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n_prompts)]
    ids = [p for p in prompts for _ in range(GROUP)]
    params = SamplingParams(temperature=temperature, max_tokens=args.tokens)
    max_len = max(map(len, prompts)) + args.tokens + 1
    # One copy of the weights for every engine: where a copy lies in memory moves a forward's time
    # by as much as the budget's own cost, and would be read as the budget's.
    base = EngineConfig(max_batch_size=batch, max_model_len=max_len, num_threads=args.threads, device=args.device)
    policy = CausalLM.from_pretrained(model, torch_dtype(base.dtype), base.device)
    engines = {c: Engine(policy, dataclasses.replace(base, spec=spec))
               for c, spec in configs(max(FIXED), ZERO_PROPOSERS if peak is None else PROPOSERS).items()}
    old = engines["plain"].generate(ids, params, seeds=[10_000 + i for i in range(len(ids))])
    return {"engines": engines, "ids": ids, "params": params, "seeds": list(range(len(ids))),
            "groups": [i // GROUP for i in range(len(ids))], "drafts": [o.token_ids for o in old],
            "draft_logprobs": [o.logprobs for o in old]}


def run_once(w: dict, config: str) -> tuple[float, float, list]:
    """(wall seconds, this process's CPU seconds, outputs)."""
    start, cpu = time.perf_counter(), time.process_time()
    outs = w["engines"][config].generate(w["ids"], w["params"], seeds=w["seeds"], groups=w["groups"],
                                         drafts=w["drafts"], draft_logprobs=w["draft_logprobs"])
    return time.perf_counter() - start, time.process_time() - cpu, outs


def paired(a: list, b: list) -> float:
    """The median over rounds of a's time over b's in the same round: the machine's load drifts
    between rounds more than within one."""
    return statistics.median(x / y for x, y in zip(a, b))


def summarize(name: str, batch: int, times: dict, outs: dict) -> dict:
    """times: config -> seconds per round (wall, or CPU with --cpu-time)."""
    med = {c: statistics.median(t) for c, t in times.items()}
    fixed = {c: v for c, v in med.items() if c.startswith("fixed") or c == "plain"}  # plain = fixed 0
    best = min(fixed, key=fixed.get)
    acc = outs["fixed 4"]
    proposed = sum(sum(o.stats["proposed"].values()) for o in acc)
    accepted = sum(sum(o.stats["accepted"].values()) for o in acc)
    priced = outs["priced"]
    return {"workload": name, "batch": batch, "acceptance_fixed4": accepted / proposed if proposed else 0.0,
            "median_s": med, "min_s": {c: min(t) for c, t in times.items()}, "best_fixed": best,
            "priced_over_plain": paired(times["priced"], times["plain"]),
            "priced_over_best_fixed": paired(times["priced"], times[best]),
            "priced_over_plain_of_medians": med["priced"] / med["plain"],
            "plain_again_over_plain": paired(times["plain again"], times["plain"]),
            "priced_proposed": sum(sum(o.stats["proposed"].values()) for o in priced),
            "priced_accepted": sum(sum(o.stats["accepted"].values()) for o in priced)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--tokens", type=int, default=48, help="response length (no stop token)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=None, help="engine threads (default: the engine's choice)")
    ap.add_argument("--device", default="cpu", help="the engines' device (cuda: a GPU's step costs)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="judge by this process's CPU seconds instead of wall seconds (with --threads 1: a cost "
                         "measure that other programs on a shared machine do not inflate; wall seconds are kept too)")
    ap.add_argument("--out", default="bench_results/spec_budget.json")
    args = ap.parse_args(argv)
    load = {"before": os.getloadavg()}
    measure = "CPU seconds" if args.cpu_time else "wall seconds"
    rows = []

    def report(complete: bool) -> dict:
        return {"complete": complete, "load_average": load, "rounds": args.rounds, "device": args.device,
                "measure": measure, "threads": args.threads or "engine default",
                "model": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab},
                "tokens": args.tokens, "results": rows}

    for name in args.workloads.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            rows.append(_measure(name, batch, args))
            save_report(report(False), args.out, quiet=True)  # a run cut short keeps the cells it finished
    load["after"] = os.getloadavg()
    print(f"\n{'workload':9}{'batch':>6}{'accept':>8}{'plain s':>9}{'priced s':>10}{'best fixed':>12}"
          f"{'priced/plain':>14}{'priced/best':>13}{'A/A':>8}")
    for r in rows:
        m = r["median_s"]
        print(f"{r['workload']:9}{r['batch']:6d}{r['acceptance_fixed4']:8.0%}{m['plain']:9.2f}{m['priced']:10.2f}"
              f"{r['best_fixed']:>12}{r['priced_over_plain']:13.2f}x{r['priced_over_best_fixed']:12.2f}x"
              f"{r['plain_again_over_plain']:7.2f}x")
    worst_plain = max(r["priced_over_plain"] for r in rows)
    worst_best = max(r["priced_over_best_fixed"] for r in rows)
    spread = max(abs(r["plain_again_over_plain"] - 1) for r in rows)
    print(f"priced budget: at worst {worst_plain:.2f}x plain's time and {worst_best:.2f}x the best fixed length's "
          f"(median ratios within {args.rounds} interleaved rounds, {measure}); two plain engines read up to "
          f"{spread:.0%} apart; load average before {load['before']}, after {load['after']}")
    return save_report(report(True), args.out)


def _measure(name: str, batch: int, args) -> dict:
    w = prepare(name, batch, args)
    names = list(w["engines"])
    for c in names:  # warm-up: a first run of each (the priced budget also profiles and learns here)
        run_once(w, c)
    times: dict = {c: [] for c in names}
    other: dict = {c: [] for c in names}  # the measure not judged by
    outs: dict = {}
    for r in range(args.rounds):
        # A fresh order each round: in a fixed rotation each configuration mostly follows the same
        # one, and what a run leaves behind (caches, the core's clock) then sides with one of them.
        order = random.Random(r).sample(names, len(names))
        for c in order:
            wall, cpu, outs[c] = run_once(w, c)
            times[c].append(cpu if args.cpu_time else wall)
            other[c].append(wall if args.cpu_time else cpu)
    ref = [o.token_ids for o in outs["plain"]]
    bad = [c for c in names if [o.token_ids for o in outs[c]] != ref]
    if bad:
        raise AssertionError(f"{name}, batch {batch}: tokens differ from plain decoding under {bad}")
    row = summarize(name, batch, times, outs)
    row["other_median_s"] = {c: statistics.median(t) for c, t in other.items()}
    print(f"{name:7} batch {batch:3d}: accept {row['acceptance_fixed4']:.0%}, "
          + ", ".join(f"{c} {statistics.median(t):.2f}s" for c, t in times.items()), flush=True)
    return row


if __name__ == "__main__":
    main()
