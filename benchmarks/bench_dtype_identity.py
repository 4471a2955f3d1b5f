"""Tokens with speculation on and off, per dtype: how many requests differ, and why.

    python -m benchmarks.bench_dtype_identity [--dtypes float32,bfloat16] [--workloads demo,bench]
                                           [--out bench_results/dtype_identity.json]

For each dtype and workload the plain engine (batch 16) samples every request; then the same
requests run again in other shapes: the plain engine at batch 4 (other rows share the forwards),
n-gram and suffix speculation (drafts found in the output, accepted and rejected), and the history
proposer fed the plain output with every 5th token changed (nearly every token is then computed in
a verify row of several tokens), at batch 16 and 4. A request differs from its first differing
token on (after it the two are different samples). At each first difference the two tokens' scores
z/T + G are recomputed in float64 from the same weights: a difference that comes from rounding in
the forward can only swap two candidates whose scores are that close (docs/dtypes.md).

Workloads: "demo" is the demo's warm-started policy (rl_integration/demo, trained: its logits have
a real model's scale) on its task's prompts with stop tokens; "bench" is benchmarks/bench.py's random
31.8M Llama on long-tail forced lengths (random weights: nearly uniform logits). Shared machine;
identity does not depend on load, only the seconds do.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import torch

from rollout import Engine, EngineConfig, SamplingParams, SpecConfig
from rollout.core.sampling import gumbel_noise

# name -> (SpecConfig kwargs or None, batch size, history drafts from the plain output)
VARIANTS = {
    "plain b4": (None, 4, False),
    "ngram b16": (dict(proposers=("ngram",)), 16, False),
    "suffix b16": (dict(proposers=("suffix",)), 16, False),
    "history b16": (dict(proposers=("history",)), 16, True),
    "history b4": (dict(proposers=("history",)), 4, True),
}
REFERENCE_BATCH = 16


@dataclasses.dataclass
class Workload:
    hf: object  # a transformers causal LM in float32
    prompts: list
    params: list
    seeds: list
    groups: list
    max_model_len: int


def demo_workload(n_prompts: int) -> Workload:
    from rl_integration.config import PolicyConfig, TaskConfig
    from rl_integration.demo.policy import load_or_train_policy
    from rl_integration.demo.task import make_problems

    task = dataclasses.replace(TaskConfig(), num_problems=n_prompts, seed=4242)
    hf, tok, _ = load_or_train_policy(task, PolicyConfig(), progress=False)
    samples = 4
    prompts = [tok(p.prompt)["input_ids"] for p in make_problems(task) for _ in range(samples)]
    params = [SamplingParams(temperature=1.0, max_tokens=200, stop_token_ids=[tok.eos_token_id])] * len(prompts)
    groups = [i // samples for i in range(len(prompts))]
    return Workload(hf.float().eval(), prompts, params, list(range(len(prompts))), groups, 512)


def bench_workload(n_prompts: int) -> Workload:
    from benchmarks.bench import bench_model, workload

    hf = bench_model(16000)
    prompts, lengths = workload(n_prompts, 16000, median=48, max_len=160)
    params = [SamplingParams(temperature=1.0, max_tokens=n) for n in lengths]
    return Workload(hf, prompts, params, list(range(n_prompts)), list(range(n_prompts)), 256)


def perturbed(outputs: list, vocab: int, every: int = 5) -> list:
    """The plain output with every `every`-th token changed: drafts rejected at known places."""
    return [[t if (i + 1) % every else (t + 1) % vocab for i, t in enumerate(o.token_ids)] for o in outputs]


def run(w: Workload, dtype: str, variant, drafts) -> tuple[list, float, int]:
    spec, batch, _ = variant
    cfg = EngineConfig(max_batch_size=batch, max_model_len=w.max_model_len, dtype=dtype, num_threads=1,
                       spec=SpecConfig(max_draft_tokens=6, min_draft_prob=0.0, **spec) if spec else None)
    engine = Engine.from_pretrained(w.hf, cfg)
    t0 = time.process_time()
    outs = engine.generate(w.prompts, w.params, seeds=w.seeds, drafts=drafts, groups=w.groups)
    accepted = sum(sum(o.stats.get("accepted", {}).values()) for o in outs)
    return outs, time.process_time() - t0, accepted


def first_difference(a: list, b: list):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def score_gap(hf64, w: Workload, i: int, plain: list, t: int, other: int) -> dict:
    """Scores z + G (T = 1) of the plain and the other token at response position t, in float64,
    and the typical margin between the best two scores there."""
    ids = torch.tensor([w.prompts[i] + plain[:t]])
    with torch.no_grad():
        z = hf64(input_ids=ids).logits[0, -1].double()
    g = gumbel_noise(torch.tensor([w.seeds[i]]), torch.tensor([t]), z.shape[0])[0].double()
    s = z / w.params[i].temperature + g
    top2 = torch.topk(s, 2).indices.tolist()
    return {"request": i, "position": t, "gap": abs(float(s[plain[t]] - s[other])),
            "swapped_top_two": sorted(top2) == sorted([plain[t], other])}


def typical_margins(hf64, w: Workload, ref: list, count: int = 24) -> list:
    """The margin between the best two scores at `count` spread-out positions (what a random,
    not rounding-made, difference would have to overcome)."""
    out = []
    for i in range(0, len(ref), max(1, len(ref) // count))[:count]:
        toks, t = ref[i].token_ids, len(ref[i].token_ids) // 2
        ids = torch.tensor([w.prompts[i] + toks[:t]])
        with torch.no_grad():
            z = hf64(input_ids=ids).logits[0, -1].double()
        g = gumbel_noise(torch.tensor([w.seeds[i]]), torch.tensor([t]), z.shape[0])[0].double()
        top = torch.topk(z + g, 2).values
        out.append(float(top[0] - top[1]))
    return out


def compare(hf64, w: Workload, ref: list, outs: list) -> dict:
    diffs, tokens_differing, lp = [], 0, 0.0
    for i, (a, b) in enumerate(zip(ref, outs)):
        t = first_difference(a.token_ids, b.token_ids)
        same = len(a.token_ids) if t is None else t
        lp = max([lp] + [abs(x - y) for x, y in zip(a.logprobs[:same], b.logprobs[:same])])
        if t is None and len(a.token_ids) == len(b.token_ids):
            continue
        if t is None:  # one stopped where the other went on: the stop token itself differs
            t = min(len(a.token_ids), len(b.token_ids))
        tokens_differing += len(a.token_ids) - t
        if t < len(a.token_ids) and t < len(b.token_ids):
            diffs.append(score_gap(hf64, w, i, a.token_ids, t, b.token_ids[t]))
    return {"requests_differing": sum(1 for a, b in zip(ref, outs) if a.token_ids != b.token_ids),
            "tokens_differing": tokens_differing, "max_logprob_difference_before_divergence": lp,
            "differences": diffs}


def measure(w: Workload, dtype: str) -> dict:
    hf64 = _rounded_copy(w.hf, dtype)
    ref, ref_s, _ = run(w, dtype, (None, REFERENCE_BATCH, False), None)
    res = {"requests": len(ref), "tokens": sum(len(o.token_ids) for o in ref), "plain_cpu_s": ref_s,
           "typical_top_two_margin": statistics.median(typical_margins(hf64, w, ref)), "variants": {}}
    for name, variant in VARIANTS.items():
        outs, secs, accepted = run(w, dtype, variant, perturbed(ref, w.hf.config.vocab_size) if variant[2] else None)
        row = {"cpu_s": secs, "accepted_draft_tokens": accepted, **compare(hf64, w, ref, outs)}
        res["variants"][name] = row
        gaps = [d["gap"] for d in row["differences"]]
        print(f"  {dtype:9} {name:12} {row['requests_differing']:3}/{len(ref)} requests, "
              f"{row['tokens_differing']:5}/{res['tokens']} tokens differ; {accepted:5} draft tokens accepted; "
              f"logprobs differ by up to {row['max_logprob_difference_before_divergence']:.2g}; "
              f"score gaps at first differences: {[f'{g:.3g}' for g in sorted(gaps)]}", flush=True)
    return res


def _rounded_copy(hf, dtype: str):
    """The model in float64 with the weights the engine runs (rounded to `dtype` first)."""
    import copy

    return copy.deepcopy(hf).to(getattr(torch, dtype)).to(torch.float64).eval()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--workloads", default="demo,bench")
    ap.add_argument("--prompts", type=int, default=16, help="demo: problems (4 samples each); bench: requests x 2")
    ap.add_argument("--out", default="bench_results/dtype_identity.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    report = {"note": "shared machine; identity does not depend on load", "load_before": os.getloadavg(),
              "torch": torch.__version__, "workloads": {}}
    makers = {"demo": lambda: demo_workload(args.prompts), "bench": lambda: bench_workload(2 * args.prompts)}
    for name in args.workloads.split(","):
        w = makers[name]()
        print(f"{name}: {len(w.prompts)} requests", flush=True)
        report["workloads"][name] = {d: measure(w, d) for d in args.dtypes.split(",")}
    report["load_after"] = os.getloadavg()
    print(f"load average before {report['load_before']}, after {report['load_after']}")
    from benchmarks.bench import save_report
    return save_report(report, args.out)


if __name__ == "__main__":
    main()
