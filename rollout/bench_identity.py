"""Speculation on against off on the bench workload: are the tokens (and logprobs) the same bits?

    python -m rollout.bench_identity [--dtypes float32,bfloat16] [--threads 1] [--against REF]
                                     [--prompts 64] [--out FILE]

The plain engine samples rollout/bench.py's workload (random Llama, vocab 16000, long-tail
forced lengths, T=1); then an engine with the "history" proposer gets that output as its
drafts, every 5th token changed, so nearly every token is computed in a verify row of several
tokens, in other batches than before. Prints, per dtype, the requests and tokens that differ
(from the first differing token on, a request's tokens are a different sample) and the largest
logprob difference over the identical prefix. With --against REF, REF's code (git archive) is
measured the same way in its own process.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--against", default=None)
    ap.add_argument("--out", default="bench_results/speed_identity.json")
    args = ap.parse_args(argv)
    report = {"threads": args.threads, "prompts": args.prompts, "trees": {}}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"this": ROOT}
        if args.against:
            from .profile import _extract
            trees = {args.against: _extract(args.against, Path(tmp)), "this": ROOT}
        for name, tree in trees.items():
            for dtype in args.dtypes.split(","):
                spec = {"dtype": dtype, "threads": args.threads, "prompts": args.prompts}
                done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
                                      cwd=tree, capture_output=True, text=True)
                if done.returncode != 0:
                    raise RuntimeError(f"identity child in {tree} failed:\n{done.stderr[-4000:]}")
                res = json.loads(done.stdout.strip().splitlines()[-1])
                report["trees"].setdefault(name, {})[dtype] = res
                print(f"{name:>10} {dtype:>9}: {res['requests_differing']}/{res['requests']} requests and "
                      f"{res['tokens_differing']}/{res['tokens']} tokens differ with speculation on; "
                      f"{res['accepted']} draft tokens accepted; largest logprob difference before a "
                      f"divergence {res['max_logprob_difference']:.3g}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return report


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
    differing, tokens_differing, max_lp = 0, 0, 0.0
    for a, b in zip(plain, spec_outs):
        same = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        if same < len(a.token_ids):
            differing += 1
            tokens_differing += len(a.token_ids) - same
        if same:
            max_lp = max(max_lp, max(abs(x - y) for x, y in zip(a.logprobs[:same], b.logprobs[:same])))
    return {"requests": len(plain), "requests_differing": differing, "tokens": sum(lengths),
            "tokens_differing": tokens_differing, "max_logprob_difference": max_lp,
            "accepted": sum(o.stats["accepted"].get("history", 0) for o in spec_outs)}


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        import os
        sys.path[0] = os.getcwd()  # the tree being measured, not this file's folder
        print(json.dumps(child(json.loads(sys.argv[2]))))
    else:
        main()
