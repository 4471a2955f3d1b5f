"""Where an engine step's time goes, and how this code compares with another commit's.

    python -m rollout.profile [--dtype float32|bfloat16] [--threads 1] [--rounds 3]
                              [--against REF] [--pin CPU] [--ops] [--out FILE]

The workload is rollout/bench.py's (random 31.8M Llama, vocab 16000, 64 long-tail requests of
forced lengths, batch 32, T=1). Every round runs in a fresh process (OpenMP reads its settings
once); with --against REF each round runs REF's code (extracted with `git archive`) and this
tree's, interleaved, and the ratio this/REF is printed last, with whether the tokens are
identical. A round reports tokens/s by wall clock and by CPU time (the process's own CPU
seconds: steadier than the wall clock on a shared machine), and the split of the rollout's
wall time: the model's forward, the sampler, building the batch, the rest of each step (the
engine's host loop: proposers, bookkeeping, acceptance) and what lies outside steps.
--ops adds where the forward's time goes, by the innermost function of rollout/ that ran
each torch op (torch.profiler with stacks, over a replay of every 8th step); the profiler's
own overhead inflates small ops, so these shares are indicative.
--pin CPU runs every process under `taskset -c CPU` (one core, as the vLLM comparison does).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPLIT = ("forward", "sampling", "build", "host", "outside")
# the innermost function of rollout/ that ran a torch op -> category (ops named below go first)
CATEGORIES = {
    "RMSNorm.forward": "rmsnorm", "rotate": "rope", "AttentionGroup.mask": "masks",
    "KVCache.write": "kv-cache write", "KVCache.write_index": "kv-cache write", "KVCache.read": "attention grids",
    "attend": "attention grids", "Attention.forward": "attention grids", "_attend_fused_group": "attention grids",
    "_attend_matmul": "attention kernel", "_attend_fused": "attention kernel", "plan": "masks", "_cpu_grid": "masks",
    "Projection.__call__": "linear layers", "CausalLM._layer": "activation, residuals, views",
    "MLP.forward": "activation, residuals, views", "DecoderLayer.forward": "activation, residuals, views",
}
LINEAR_OPS = {"aten::mm", "aten::addmm", "aten::linear", "mkldnn::_linear_pointwise",
              "mkldnn::_linear_pointwise.binary"}
ATTENTION_OPS = {"aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
                 "aten::_scaled_dot_product_attention_math", "aten::bmm"}

def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--against", default=None, help="a git commit or branch to compare with")
    ap.add_argument("--pin", default=None, help="CPU list for taskset (e.g. 1)")
    ap.add_argument("--ops", action="store_true", help="also split the forward by function (torch.profiler)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    trees = {"this": ROOT}
    with tempfile.TemporaryDirectory() as tmp:
        if args.against:
            trees = {args.against: _extract(args.against, Path(tmp)), "this": ROOT}
        rounds = {name: [] for name in trees}
        for r in range(args.rounds):
            for name, tree in trees.items():
                res = _run_child(tree, args, ops=args.ops and r == 0)
                rounds[name].append(res)
                print(f"round {r} {name:>12}: {_line(res)}", flush=True)
    report = _summarise(rounds, args)
    out = Path(args.out or f"bench_results/profile_{args.dtype}_{args.threads}t.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return report


def _extract(ref: str, into: Path) -> Path:
    tree = into / "ref"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def _run_child(tree: Path, args, ops: bool) -> dict:
    spec = {"dtype": args.dtype, "threads": args.threads, "prompts": args.prompts, "ops": ops}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    if args.pin is not None:
        cmd = ["taskset", "-c", str(args.pin)] + cmd
    done = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"profile child in {tree} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _line(res: dict) -> str:
    split = " ".join(f"{k} {res['split'][k]:.2f}s" for k in SPLIT)
    return (f"{res['tokens_per_second']:7.1f} tok/s wall, {res['tokens_per_cpu_second']:7.1f} tok/CPU-s; "
            f"{split}; load {res['load_before'][0]:.1f}->{res['load_after'][0]:.1f}")


def _summarise(rounds: dict, args) -> dict:
    report = {"dtype": args.dtype, "threads": args.threads, "pin": args.pin, "rounds": args.rounds,
              "note": "shared machine: compare ratios of interleaved rounds", "trees": {}}
    print(f"\n{args.dtype}, {args.threads} thread(s){', pinned to CPU ' + args.pin if args.pin else ''}")
    print(f"{'':>12} {'tok/s best':>11} {'median':>8} {'tok/CPU-s best':>15} {'median':>8}   "
          + " ".join(f"{k:>9}" for k in SPLIT))
    for name, results in rounds.items():
        wall = [r["tokens_per_second"] for r in results]
        cpu = [r["tokens_per_cpu_second"] for r in results]
        split = {k: statistics.median(r["split"][k] for r in results) for k in SPLIT}
        total = sum(split.values())
        report["trees"][name] = {"tokens_per_second": {"best": max(wall), "median": statistics.median(wall)},
                                 "tokens_per_cpu_second": {"best": max(cpu), "median": statistics.median(cpu)},
                                 "split_seconds_median": split, "rounds": results}
        print(f"{name:>12} {max(wall):11.1f} {statistics.median(wall):8.1f} {max(cpu):15.1f} "
              f"{statistics.median(cpu):8.1f}   " + " ".join(f"{100 * split[k] / total:8.1f}%" for k in SPLIT))
        if results[0].get("ops"):
            _print_ops(name, results[0]["ops"])
    if args.against:
        base, this = report["trees"][args.against], report["trees"]["this"]
        ratio = {k: this[k]["best"] / base[k]["best"] for k in ("tokens_per_second", "tokens_per_cpu_second")}
        same = rounds["this"][0]["tokens_hash"] == rounds[args.against][0]["tokens_hash"]
        report["ratio_this_over_ref"], report["tokens_identical"] = ratio, same
        print(f"this / {args.against}: {ratio['tokens_per_second']:.2f}x tokens/s (wall, best), "
              f"{ratio['tokens_per_cpu_second']:.2f}x tokens/CPU-s (best); tokens identical: {same}")
    return report


def _print_ops(name: str, ops: dict) -> None:
    total = sum(ops.values())
    print(f"{'':>12}   forward by function ({name}): " + ", ".join(
        f"{k} {100 * v / total:.1f}%" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])))


# ------------------------------------------------------------------------------ the child

def child(spec: dict) -> dict:
    """One round in this process, with the code of the current folder (the tree to measure)."""
    import hashlib
    import time

    import rollout  # noqa: F401 -- first: OpenMP's wait policy (rollout/threads.py)
    import rollout.engine as engine_module
    from rollout import Engine, EngineConfig, SamplingParams, bench, sampling

    model = bench.bench_model(16000)
    prompts, lengths = bench.workload(spec["prompts"], 16000, 48, 384)
    max_model_len = max(len(p) for p in prompts) + 385
    eng = Engine.from_pretrained(model, EngineConfig(max_batch_size=32, max_model_len=max_model_len,
                                                     dtype=spec["dtype"], num_threads=spec["threads"]))
    params = [SamplingParams(temperature=1.0, max_tokens=n) for n in lengths]
    eng.generate(prompts[:2], params[:2], seeds=[0, 1])  # warm-up
    acc = dict.fromkeys(("forward", "sampling", "build", "step"), 0.0)
    steps = []
    _time_calls(sampling, "sample", acc, "sampling")
    _time_calls(eng.model, "forward", acc, "forward")
    _time_calls(eng, "_step", acc, "step")
    build = engine_module.ForwardBatch.build

    def timed_build(rows, *a, **kw):
        t = time.perf_counter()
        steps.append((rows, a, kw))
        out = build(rows, *a, **kw)
        acc["build"] += time.perf_counter() - t
        return out

    engine_module.ForwardBatch.build = staticmethod(timed_build)
    load_before = os.getloadavg()
    wall, cpu = time.perf_counter(), time.process_time()
    outs = eng.generate(prompts, params, seeds=list(range(len(prompts))))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    engine_module.ForwardBatch.build = staticmethod(build)
    useful = sum(lengths)
    split = {"forward": acc["forward"], "sampling": acc["sampling"], "build": acc["build"],
             "host": acc["step"] - acc["forward"] - acc["sampling"] - acc["build"], "outside": wall - acc["step"]}
    tokens = json.dumps([o.token_ids for o in outs]).encode()
    res = {"tokens_per_second": useful / wall, "tokens_per_cpu_second": useful / cpu, "wall_seconds": wall,
           "cpu_seconds": cpu, "engine_steps": len(steps), "split": split, "load_before": load_before,
           "load_after": os.getloadavg(), "tokens_hash": hashlib.sha256(tokens).hexdigest()}
    if spec["ops"]:
        res["ops"] = _forward_ops(eng, build, steps[::8])
    return res


def _time_calls(owner, name: str, acc: dict, key: str) -> None:
    import time

    inner = getattr(owner, name)

    def timed(*a, **kw):
        t = time.perf_counter()
        out = inner(*a, **kw)
        acc[key] += time.perf_counter() - t
        return out

    setattr(owner, name, timed)


def _forward_ops(eng, build, steps) -> dict:
    """Self CPU seconds of the forward's torch ops by category, over a replay of `steps`."""
    from torch.profiler import ProfilerActivity, profile

    batches = [build(rows, *a, **kw) for rows, a, kw in steps]
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        for batch in batches:
            eng.model(batch, eng.cache)
    names = _function_names()
    totals: dict[str, float] = {}
    for event in prof.events():
        if "::" in event.name:
            cat = _category(event.name, _callers(event), names)
            totals[cat] = totals.get(cat, 0.0) + event.self_cpu_time_total / 1e6
    return totals


def _callers(event) -> list:
    """Names of the enclosing events, innermost first; Python calls read 'path(line): name'."""
    names, parent = [], event.cpu_parent
    while parent is not None:
        names.append(parent.name)
        parent = parent.cpu_parent
    return names


def _function_names() -> dict:
    """file name -> [(first line, last line, qualified name)] of every function of rollout's modules."""
    import inspect

    names: dict[str, list] = {}
    for module in [m for n, m in sys.modules.items() if n.startswith("rollout.") and m is not None]:
        for obj in vars(module).values():
            funcs = [obj] if inspect.isfunction(obj) else list(vars(obj).values()) if inspect.isclass(obj) else []
            for f in funcs:
                code = getattr(inspect.unwrap(f) if callable(f) else f, "__code__", None)
                if code is not None and code.co_filename.startswith(os.getcwd()):
                    lines = [line for _, _, line in code.co_lines() if line is not None]
                    names.setdefault(Path(code.co_filename).name, []).append(
                        (min(lines), max(lines), code.co_qualname))
    return names


def _category(op: str, stack: list, names: dict) -> str:
    """stack: innermost first, Python frames like '/path/rollout/model.py(120): forward'."""
    if op in ATTENTION_OPS:
        return "attention kernel"
    qualname = ""
    for frame in stack:
        if "rollout/" in frame and "profile.py" not in frame:
            file, line = frame.split("rollout/")[-1].split(": ")[0].rstrip(")").split("(")
            qualname = next((q for a, b, q in names.get(file, []) if a <= int(line) <= b), "")
            break
    if op in LINEAR_OPS:
        return "linear layers"
    return CATEGORIES.get(qualname, "other (embedding, rope tables, casts, views)")

if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        sys.path[0] = os.getcwd()  # the tree being measured, not this file's folder
        print(json.dumps(child(json.loads(sys.argv[2]))))
    else:
        main()
