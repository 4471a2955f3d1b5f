"""Are the tokens the same bits with speculation on and off, and at 1 and 2 threads? Measured
on the engine bench's workload, per dtype.

    python -m rollout.bench_identity [--dtypes float32,bfloat16] [--threads 1,2] [--prompts 64]
                                     [--against REF] [--out FILE]

The plain engine samples rollout/bench.py's workload (random 31.8M Llama, vocab 16000, long-tail
forced lengths, T=1); then an engine with the "history" proposer gets that output as its drafts,
every 5th token changed, so nearly every token is computed in a verify row of several tokens, in
other batches than before (batch 24 instead of 32). Each thread count runs in its own process.
Prints, per dtype and thread count, the requests and tokens that differ with speculation on
(from a request's first differing token on, its tokens are another sample), the largest logprob
difference over the identical prefixes, and whether the plain tokens equal those of the first
thread count. With --against REF, REF's code (git archive) is measured the same way.
docs/dtypes.md states what these show.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--against", default=None, help="a git commit or branch measured the same way")
    ap.add_argument("--out", default="bench_results/spec_identity.json")
    args = ap.parse_args(argv)
    report = {"note": "shared machine; identity does not depend on load", "prompts": args.prompts,
              "load_before": os.getloadavg(), "trees": {}}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"this": ROOT}
        if args.against:
            from .profile import _extract
            trees = {args.against: _extract(args.against, Path(tmp)), "this": ROOT}
        for name, tree in trees.items():
            for dtype in args.dtypes.split(","):
                report["trees"].setdefault(name, {})[dtype] = _measure(tree, name, dtype, args)
    report["load_after"] = os.getloadavg()
    from .bench import save_report
    return save_report(report, args.out)


def _measure(tree: Path, name: str, dtype: str, args) -> dict:
    """Every thread count of one dtype, in fresh processes; plain tokens compared across them."""
    out, first = {}, None
    for threads in (int(t) for t in args.threads.split(",")):
        spec = {"dtype": dtype, "threads": threads, "prompts": args.prompts}
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
                              cwd=tree, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"identity child in {tree} failed:\n{done.stderr[-4000:]}")
        res = json.loads(done.stdout.strip().splitlines()[-1])
        plain = res.pop("plain_tokens")
        first = plain if first is None else first
        res["plain_equals_first_thread_count"] = plain == first
        out[f"{threads}t"] = res
        print(f"{name:>10} {dtype:>9} {threads}t: {res['requests_differing']}/{res['requests']} requests and "
              f"{res['tokens_differing']}/{res['tokens']} tokens differ with speculation on "
              f"({res['accepted']} draft tokens accepted); largest logprob difference before a divergence "
              f"{res['max_logprob_difference']:.3g}; plain tokens equal to the first thread count's: "
              f"{res['plain_equals_first_thread_count']}", flush=True)
    return out


def compare(plain: list, spec: list) -> dict:
    """Requests and tokens that differ (from each request's first difference on), and the largest
    logprob difference over the identical prefixes."""
    differing, tokens_differing, max_lp = 0, 0, 0.0
    for a, b in zip(plain, spec):
        same = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        if same < len(a.token_ids):
            differing += 1
            tokens_differing += len(a.token_ids) - same
        if same:
            max_lp = max(max_lp, max(abs(x - y) for x, y in zip(a.logprobs[:same], b.logprobs[:same])))
    return {"requests": len(plain), "requests_differing": differing, "tokens": sum(len(a.token_ids) for a in plain),
            "tokens_differing": tokens_differing, "max_logprob_difference": max_lp}


def child(spec: dict) -> dict:
    import rollout  # noqa: F401 -- first: OpenMP's wait policy (rollout/threads.py)
    from rollout import Engine, EngineConfig, SamplingParams, SpecConfig, bench

    model = bench.bench_model(16000)
    prompts, lengths = bench.workload(spec["prompts"], 16000, 48, 384)
    max_model_len = max(len(p) for p in prompts) + 385
    params = [SamplingParams(temperature=1.0, max_tokens=n) for n in lengths]
    seeds = list(range(len(prompts)))

    def engine(batch, spec_config):
        return Engine.from_pretrained(model, EngineConfig(max_batch_size=batch, max_model_len=max_model_len,
                                                          dtype=spec["dtype"], num_threads=spec["threads"],
                                                          spec=spec_config))

    plain = engine(32, None).generate(prompts, params, seeds=seeds)
    drafts = [[(t + 1) % 16000 if i % 5 == 4 else t for i, t in enumerate(o.token_ids)] for o in plain]
    history = SpecConfig(proposers=("history",), max_draft_tokens=6, min_draft_prob=0.0)
    spec_outs = engine(24, history).generate(prompts, params, seeds=seeds, drafts=drafts)
    return {**compare(plain, spec_outs), "accepted": sum(o.stats["accepted"].get("history", 0) for o in spec_outs),
            "plain_tokens": [o.token_ids for o in plain]}


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        sys.path[0] = os.getcwd()  # the tree being measured, not this file's folder
        print(json.dumps(child(json.loads(sys.argv[2]))))
    else:
        main()
