"""Threads on a shared machine: the same short rollout and a few optimizer steps, quiet and
beside a CPU-burning process this benchmark starts itself (`python -m benchmarks.bench --busy`).

Every measurement runs in a fresh process, because OpenMP reads its wait policy once, when
torch loads. Settings, each measured quiet and busy, rounds interleaved:
    defaults       what spectail chooses (rollout/core/threads.py)
    1 thread       engine and optimizer steps on one thread
    2 threads      both on two threads, passive waiting
    2 spinning     both on two threads with OpenMP's default spinning (what spectail did before)
Models: the demo policy's size (too small to gain from a second thread) and a larger one that
does. Prints seconds (min and median over rounds), the busy/quiet ratio per setting, and the
load average; writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks.bench import save_report

SETTINGS = {  # name -> (engine and trainer threads (None: spectail's choice), extra environment)
    "defaults": (None, {}),
    "1 thread": (1, {}),
    "2 threads": (2, {"OMP_WAIT_POLICY": "PASSIVE"}),
    "2 spinning": (2, {"GOMP_SPINCOUNT": "300000"}),  # libgomp's own default spin count
}
MODELS = {"demo-size": dict(hidden=128, layers=4), "larger": dict(hidden=512, layers=4)}
_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def child(hidden: int, layers: int, num_threads, requests: int, tokens: int, train_steps: int) -> dict:
    """One measurement in this (fresh) process: rollout seconds and optimizer-step seconds."""
    # the wait policy was set when this process imported `benchmarks` (benchmarks/__init__.py)
    import torch
    import transformers

    from rollout import Engine, EngineConfig, SamplingParams
    from rollout.core import threads

    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    engine = Engine.from_pretrained(model.eval(), EngineConfig(max_batch_size=requests, max_model_len=256,
                                                               num_threads=num_threads))
    prompts = [[1 + i % 500, 2, 3, 4, 5, 6, 7, 8] for i in range(requests)]
    params = SamplingParams(max_tokens=tokens)
    engine.generate(prompts[:2], params, seeds=[0, 1])  # warm-up
    used = []  # the threads the run really used
    t0 = time.perf_counter()
    engine.generate(prompts, params, seeds=list(range(requests)),
                    on_finish=lambda r: used.append(torch.get_num_threads()))
    rollout_s = time.perf_counter() - t0

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 512, (16, 128))
    with threads.using(threads.trainer_threads(num_threads)):
        t0 = time.perf_counter()
        for _ in range(train_steps):
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
        train_s = time.perf_counter() - t0
        train_threads = torch.get_num_threads()
    return {"rollout_s": rollout_s, "train_s": train_s, "engine_threads": max(used),
            "train_threads": train_threads, "tokens": requests * tokens}


def _measure(model: str, setting: str, args) -> dict:
    num_threads, extra = SETTINGS[setting]
    env = {k: v for k, v in os.environ.items() if k not in _WAIT_VARS}
    env.update(extra)
    spec = {**MODELS[model], "num_threads": num_threads, "requests": args.requests, "tokens": args.tokens,
            "train_steps": args.train_steps}
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_threads", "--child", json.dumps(spec)],
                         env=env, capture_output=True, text=True, timeout=args.timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{model}/{setting} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _burner() -> subprocess.Popen:
    """A single-threaded CPU-bound process: the other program a laptop always has."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=60)
    ap.add_argument("--train-steps", type=int, default=3)
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {list(MODELS)}")
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {list(SETTINGS)}")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one measurement may take")
    ap.add_argument("--out", default="bench_results/threads.json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(**json.loads(args.child))))
        return {}

    models, settings = args.models.split(","), args.settings.split(",")
    runs: dict = {}
    load = {"before": os.getloadavg()}
    for r in range(args.rounds):
        for model in models:
            for setting in settings:
                for busy in (False, True):
                    burner = _burner() if busy else None
                    try:
                        if burner is not None:
                            time.sleep(0.5)  # let it take its core
                        res = _measure(model, setting, args)
                    finally:
                        if burner is not None:
                            burner.kill()
                            burner.wait()
                    runs.setdefault((model, setting, busy), []).append(res)
                    print(f"round {r} {model:9} {setting:10} {'busy ' if busy else 'quiet'} rollout "
                          f"{res['rollout_s']:6.2f}s  train {res['train_s']:6.2f}s  threads "
                          f"{res['engine_threads']}/{res['train_threads']}", flush=True)
    load["after"] = os.getloadavg()
    report = {"load_average": load, "rounds": args.rounds, "results": []}
    print(f"\n{'model':10}{'setting':12}{'threads':>8}{'quiet s (min/med)':>20}{'busy s (min/med)':>19}"
          f"{'busy/quiet':>11}")
    for model in models:
        for setting in settings:
            quiet, busy = runs[(model, setting, False)], runs[(model, setting, True)]
            q = [x["rollout_s"] + x["train_s"] for x in quiet]
            b = [x["rollout_s"] + x["train_s"] for x in busy]
            ratio = statistics.median(b) / statistics.median(q)
            row = {"model": model, "setting": setting, "engine_threads": quiet[0]["engine_threads"],
                   "train_threads": quiet[0]["train_threads"], "quiet_s": q, "busy_s": b,
                   "quiet_rollout_s": [x["rollout_s"] for x in quiet], "busy_rollout_s": [x["rollout_s"] for x in busy],
                   "quiet_train_s": [x["train_s"] for x in quiet], "busy_train_s": [x["train_s"] for x in busy],
                   "busy_over_quiet": ratio,
                   "quiet_rollout_tokens_per_s": [x["tokens"] / x["rollout_s"] for x in quiet],
                   "busy_rollout_tokens_per_s": [x["tokens"] / x["rollout_s"] for x in busy]}
            report["results"].append(row)
            print(f"{model:10}{setting:12}{row['engine_threads']:>4}/{row['train_threads']:<3}"
                  f"{min(q):9.2f} /{statistics.median(q):6.2f}{min(b):12.2f} /{statistics.median(b):6.2f}"
                  f"{ratio:10.2f}x")
    _print_rollout_rates(report["results"])
    print(f"load average (1, 5, 15 min) before {load['before']}, after {load['after']}")
    return save_report(report, args.out)


def _print_rollout_rates(rows: list) -> None:
    """Rollout tokens/s per setting (min / median), and each setting against 1 thread beside the burner."""
    print(f"\n{'model':10}{'setting':12}{'quiet tok/s (min/med)':>24}{'busy tok/s (min/med)':>23}"
          f"{'busy vs 1 thread busy':>23}")
    one = {r["model"]: statistics.median(r["busy_rollout_tokens_per_s"]) for r in rows if r["setting"] == "1 thread"}
    for r in rows:
        q, b = r["quiet_rollout_tokens_per_s"], r["busy_rollout_tokens_per_s"]
        vs = f"{statistics.median(b) / one[r['model']]:.2f}x" if r["model"] in one else "-"
        print(f"{r['model']:10}{r['setting']:12}{min(q):11.0f} /{statistics.median(q):7.0f}{min(b):13.0f} /"
              f"{statistics.median(b):7.0f}{vs:>20}")


if __name__ == "__main__":
    main()
