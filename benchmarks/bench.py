"""Long-tail rollout benchmark: Hugging Face `generate` against the engine, side by side.

The workload is what RL rollouts look like: many prompts whose response lengths follow a
heavy-tailed distribution. The model is a random ~30M-parameter Llama, so lengths are set by
max_tokens (no stop token). Useful tokens are the tokens each request asked for; Hugging Face
`generate` (batched sampling with left padding, the way trainers use it without an inference
server) must run every batch until its longest request is done, which is the long tail's cost.

    python -m benchmarks.bench [--prompts 64] [--batch 32] [--out bench_results/rollout.json]
    python -m benchmarks.bench --busy [...]   threads on a shared machine (benchmarks/bench_threads.py)
    python -m benchmarks.bench --spec [...]   the draft budget against plain and fixed lengths
    python -m benchmarks.bench --peer vllm [...]   against vLLM on the same CPU (benchmarks/bench_vllm.py)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from rollout import Engine, EngineConfig, SamplingParams, SpecConfig


def bench_model(vocab: int, seed: int = 0):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=512, intermediate_size=1408,
                                   num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                                   max_position_embeddings=2048, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


def workload(n: int, vocab: int, median: int, max_len: int, seed: int = 0):
    """Prompts of 16-64 tokens; response lengths lognormal (sigma 1), clipped to [4, max_len]."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, vocab, size=int(rng.integers(16, 65))).tolist() for _ in range(n)]
    lengths = np.clip(rng.lognormal(np.log(median), 1.0, size=n), 4, max_len).astype(int).tolist()
    return prompts, lengths


def run_hf(model, prompts, lengths, batch: int) -> float:
    pad = 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        ps, ls = prompts[i:i + batch], lengths[i:i + batch]
        width = max(len(p) for p in ps)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in ps])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                           top_p=1.0, max_new_tokens=max(ls), min_new_tokens=max(ls), pad_token_id=pad)
    return time.perf_counter() - start


def run_engine(model, prompts, lengths, batch: int, spec, max_model_len: int):
    eng = Engine.from_pretrained(model, EngineConfig(max_batch_size=batch, max_model_len=max_model_len, spec=spec))
    params = [SamplingParams(temperature=1.0, max_tokens=n) for n in lengths]
    eng.generate(prompts[:2], params[:2], seeds=[0, 1])  # warm-up
    start = time.perf_counter()
    outs = eng.generate(prompts, params, seeds=list(range(len(prompts))))
    seconds = time.perf_counter() - start
    assert [len(o.token_ids) for o in outs] == lengths
    return seconds, outs


def _peer(argv: list) -> dict:
    """--peer vllm: the same workload against vLLM, side by side (benchmarks/bench_vllm.py)."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--peer", choices=["vllm"], required=True)
    args, rest = ap.parse_known_args(argv)
    from benchmarks import bench_vllm
    return bench_vllm.main(rest)


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--peer" in argv or any(a.startswith("--peer=") for a in argv):
        return _peer(argv)
    if "--busy" in argv:
        from benchmarks import bench_threads
        return bench_threads.main([a for a in argv if a != "--busy"])
    if "--spec" in argv:
        from benchmarks import bench_spec
        return bench_spec.main([a for a in argv if a != "--spec"])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--median", type=int, default=48, help="median response length")
    ap.add_argument("--max-len", type=int, default=384, help="longest response")
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    ap.add_argument("--out", default="bench_results/rollout.json")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    model = bench_model(args.vocab)
    params = sum(p.numel() for p in model.parameters())
    prompts, lengths = workload(args.prompts, args.vocab, args.median, args.max_len)
    useful = sum(lengths)
    max_model_len = max(len(p) for p in prompts) + args.max_len + 1
    print(f"model: Llama, {params / 1e6:.1f}M parameters, vocab {args.vocab}; {args.prompts} prompts, "
          f"batch {args.batch}; response lengths median {int(np.median(lengths))}, "
          f"p99 {int(np.percentile(lengths, 99))}, max {max(lengths)}; {useful} useful tokens; "
          f"{torch.get_num_threads()} threads")

    results = {}
    hf_s = run_hf(model, prompts, lengths, args.batch)
    results["hf_generate"] = {"seconds": hf_s}
    plain_s, plain = run_engine(model, prompts, lengths, args.batch, None, max_model_len)
    results["engine"] = {"seconds": plain_s}
    spec = SpecConfig(proposers=("ngram",), max_draft_tokens=4)
    ngram_s, ngram = run_engine(model, prompts, lengths, args.batch, spec, max_model_len)
    results["engine_ngram"] = {"seconds": ngram_s, "identical_to_plain":
                               [o.token_ids for o in ngram] == [o.token_ids for o in plain],
                               "accepted": sum(o.stats["accepted"].get("ngram", 0) for o in ngram),
                               "proposed": sum(o.stats["proposed"].get("ngram", 0) for o in ngram)}
    for r in results.values():
        r["tokens_per_second"] = useful / r["seconds"]
        r["speedup_vs_hf"] = hf_s / r["seconds"]
    print(f"{'':16}{'seconds':>9}{'tok/s':>9}{'vs HF':>8}")
    for name, r in results.items():
        print(f"{name:16}{r['seconds']:9.2f}{r['tokens_per_second']:9.1f}{r['speedup_vs_hf']:7.2f}x")
    ng = results["engine_ngram"]
    print(f"ngram: accepted {ng['accepted']}/{ng['proposed']} drafted tokens; "
          f"tokens identical to the plain engine: {ng['identical_to_plain']}")
    report = {"model_parameters": params, "prompts": args.prompts, "batch": args.batch, "useful_tokens": useful,
              "threads": torch.get_num_threads(), "lengths": lengths, "results": results}
    return save_report(report, args.out)


def report_cases(args, header: str, cases, measure, line) -> dict:
    """A microbenchmark's table: `header`, then `line(result)` for `measure(*case)` of each case;
    written as JSON to args.out with the arguments and the load average before and after."""
    load = os.getloadavg()
    print(header)
    results = []
    for case in cases:
        results.append(measure(*case))
        print(line(results[-1]))
    report = {"args": vars(args), "load_before": list(load), "load_after": list(os.getloadavg()), "results": results}
    return save_report(report, args.out)


def save_report(report: dict, path: str, quiet: bool = False) -> dict:
    """Write a benchmark's JSON (folders made as needed) and say where (unless quiet)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=2) + "\n")
    if not quiet:
        print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
