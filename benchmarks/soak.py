"""Soak test: many long-tail requests through ONE engine, in waves, watching memory and state.

    python -m benchmarks.soak                       # 10,000 requests (a few minutes on one core)
    python -m benchmarks.soak --requests 400        # the short version `make test` runs

Each wave is one `Engine.generate` call shaped like a GRPO rollout step: a slice of a fixed
prompt pool, `--group` samples per prompt tied by a group id (fresh ids every wave, as the
RolloutClient hands them out; every eighth prompt's samples go without a group), lognormal
`max_tokens` (the long tail), a stop token, mixed top-k / top-p, and every proposer on: the
response to the same (prompt, sample index) in the last wave that had it is the history draft,
with its logprobs. Half the prompts keep their seeds across waves (the old response reproduces itself:
long accepted runs), half draw fresh noise (drafts mostly rejected: lookahead and re-alignment).
Each wave also makes one call that must fail validation.

After every wave the process's resident memory (from /proc/self/statm) and the number of
objects the garbage collector tracks are sampled, and `leftover_state` lists what the idle
engine still holds per request or per group. The run FAILS (exit status 1, a message naming
what) when, after the warm-up waves, resident memory grows by more than `--max-growth` (5%)
over its value at the end of the warm-up, when the tracked objects grow by more than
`--max-objects-per-request` per request served after it, when any state is left behind, or
when the tokens of a checked wave differ from a plain (no speculation) engine's. The curve
goes to a PNG beside the JSON.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from rollout import Engine, EngineConfig, SamplingParams, SpecConfig
from rollout.core.seeds import prompt_key, sample_seed

PROPOSERS = ("history", "suffix", "lookahead", "ngram")
STOP = 0  # the stop token id


# ---- what is measured ----------------------------------------------------------------------


def rss_bytes() -> int:
    """Resident memory now. /proc/self/statm (Linux); elsewhere the peak from getrusage, which
    can only rise, so growth measured with it is an upper bound."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def leftover_state(engine) -> dict[str, int]:
    """What an idle engine still holds outside its requests: {table: entries}, empty when nothing
    was left behind (`Engine.state_sizes()`; a request's own proposer state goes with it)."""
    return {k: int(v) for k, v in engine.state_sizes().items() if v}


# ---- the workload --------------------------------------------------------------------------


def soak_model(vocab: int, seed: int = 0):
    """A random Llama small enough that a step's cost is the engine's host work, not the model."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                                   tie_word_embeddings=False)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


def make_pool(num_prompts: int, vocab: int, max_len: int, seed: int = 0) -> list[dict]:
    """Prompts of 4-16 tokens, each with its own long-tail max_tokens and sampling settings."""
    rng = random.Random(seed)
    pool = []
    for i in range(num_prompts):
        ids = [rng.randrange(1, vocab) for _ in range(rng.randrange(4, 17))]
        length = min(max_len, max(2, int(rng.lognormvariate(math.log(16), 0.9))))
        top_k, top_p = [(0, 1.0), (8, 1.0), (0, 0.9)][i % 3]
        params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, max_tokens=length, stop_token_ids=(STOP,))
        pool.append({"ids": ids, "key": prompt_key(ids), "params": params, "keep_seed": i % 2 == 0})
    return pool


def wave_inputs(pool, wave: int, prompts_per_wave: int, group: int, next_group: int, history: dict) -> dict:
    """generate()'s arguments for one wave; history: (pool index, sample) -> (tokens, logprobs)."""
    start = wave * prompts_per_wave
    picked = [(start + j) % len(pool) for j in range(prompts_per_wave)]
    rows = [(p, s) for p in picked for s in range(group)]
    old = [history.get(r) for r in rows]
    return {
        "prompt_token_ids": [pool[p]["ids"] for p, _ in rows],
        "sampling_params": [pool[p]["params"] for p, _ in rows],
        "seeds": [sample_seed(0, pool[p]["key"], s, None if pool[p]["keep_seed"] else wave) for p, s in rows],
        "drafts": [None if h is None else h[0] for h in old],
        "draft_logprobs": [None if h is None else h[1] for h in old],
        "groups": [None if p % 8 == 7 else next_group + j // group for j, (p, _) in enumerate(rows)],
        "rows": rows,
    }


# ---- the run -------------------------------------------------------------------------------


@dataclass(frozen=True)
class SoakConfig:
    requests: int = 10_000
    prompts_per_wave: int = 50
    group: int = 4  # samples per prompt
    pool_size: int = 150  # distinct prompts; waves cycle through them
    vocab: int = 64
    max_len: int = 128  # the longest response
    batch: int = 32  # the engine's slots
    warmup: Optional[int] = None  # waves; None: a tenth, and at least until every prompt has a history
    check_waves: int = 2  # waves compared token for token with a plain engine (the last ones)
    max_growth: float = 0.05  # resident memory after the warm-up, relative
    max_objects_per_request: float = 0.05  # gc-tracked objects gained per request after the warm-up
    device: str = "cpu"  # the engine's; resident memory is the host's either way

    @property
    def waves(self) -> int:
        return max(2, math.ceil(self.requests / (self.prompts_per_wave * self.group)))

    @property
    def warmup_waves(self) -> int:
        if self.warmup is not None:
            return self.warmup
        return max(math.ceil(self.pool_size / self.prompts_per_wave) + 1, self.waves // 10)


def run_soak(cfg: SoakConfig = SoakConfig(), echo=print) -> dict:
    waves, warmup, per_wave = cfg.waves, cfg.warmup_waves, cfg.prompts_per_wave * cfg.group
    if not 0 < warmup < waves:
        raise ValueError(f"warmup must be in [1, {waves - 1}] for {waves} waves, got {warmup}")
    engine, plain = make_engines(cfg)
    pool = make_pool(cfg.pool_size, cfg.vocab, cfg.max_len)
    checked = set(range(waves - 1, warmup - 1, -1)[:cfg.check_waves])
    history, samples, failures = {}, [], []
    start = time.perf_counter()
    for wave in range(waves):
        args = wave_inputs(pool, wave, cfg.prompts_per_wave, cfg.group, wave * cfg.prompts_per_wave, history)
        rows = args.pop("rows")
        t0 = time.perf_counter()
        outs = engine.generate(**args)
        seconds = time.perf_counter() - t0
        history.update((r, (o.token_ids, o.logprobs)) for r, o in zip(rows, outs))
        # A plain engine that checks waves also runs in the warm-up's last wave: what its first
        # call builds once (its layers' weight packs) is not growth.
        compare = wave in checked or (checked and wave == warmup - 1)
        failures += wave_failures(engine, plain if compare else None, args, outs, wave)
        figures = _figures(outs, seconds, time.perf_counter() - start)
        del outs  # (the completions' stats hold as many lists as proposers drafted for them: not growth)
        gc.collect()
        samples.append(_sample(wave, (wave + 1) * per_wave, figures))
        if torch.device(cfg.device).type == "cuda":
            samples[-1]["cuda_allocated_mib"] = torch.cuda.memory_allocated(cfg.device) / 2**20
        if wave == warmup - 1 or (wave + 1) % max(1, waves // 10) == 0:
            s = samples[-1]
            echo(f"wave {wave + 1}/{waves}: {s['requests']} requests, rss {s['rss_mib']:.1f} MiB, "
                 f"{s['gc_objects']} objects, {s['tokens']} tokens in {seconds:.2f} s")
    report = dict(dataclasses.asdict(cfg), requests=waves * per_wave, waves=waves, warmup_waves=warmup,
                  requests_per_wave=per_wave, proposers=list(PROPOSERS), checked_waves=sorted(checked),
                  seconds=time.perf_counter() - start, torch_threads=engine.num_threads,
                  loadavg=list(os.getloadavg()), samples=samples)
    report.update(growth(samples, warmup))
    failures += growth_failures(report, cfg.max_growth, cfg.max_objects_per_request)
    report["failures"], report["passed"] = failures, not failures
    return report


def make_engines(cfg: SoakConfig):
    """The engine under test (every proposer on) and a plain one on the same weights."""
    model = soak_model(cfg.vocab)
    max_model_len = 16 + cfg.max_len + 1
    spec = SpecConfig(proposers=PROPOSERS, max_draft_tokens=8)
    engine = Engine.from_pretrained(model, EngineConfig(max_batch_size=cfg.batch, max_model_len=max_model_len,
                                                        max_num_batched_tokens=512, spec=spec, device=cfg.device))
    plain = Engine.from_pretrained(model, EngineConfig(max_batch_size=cfg.batch, max_model_len=max_model_len,
                                                       device=cfg.device))
    return engine, plain


def wave_failures(engine, plain, args: dict, outs, wave: int) -> list[str]:
    """What is wrong after a wave: state left behind, a bad call that did not fail cleanly, and
    (when `plain` is given) tokens that differ from plain decoding's."""
    failures = _bad_call_leaves_nothing(engine, wave)
    left = leftover_state(engine)
    if left:
        failures.append(f"wave {wave}: state left behind in the idle engine: {left}")
    if plain is not None and [o.token_ids for o in plain.generate(**args)] != [o.token_ids for o in outs]:
        failures.append(f"wave {wave}: tokens differ from the plain engine's")
    return failures


def _bad_call_leaves_nothing(engine, wave: int) -> list[str]:
    """A call that fails validation must raise ValueError and leave nothing behind."""
    try:
        engine.generate([[1, 2], [3, 10**6]], SamplingParams(max_tokens=4), groups=[wave, wave])
    except ValueError:
        return []
    return [f"wave {wave}: an out-of-vocabulary prompt did not raise ValueError"]


def _figures(outs, seconds: float, elapsed: float) -> dict:
    """A wave's figures from its completions."""
    return {"tokens": sum(len(o.token_ids) for o in outs),
            "accepted": sum(sum(o.stats["accepted"].values()) for o in outs),
            "proposed": sum(sum(o.stats["proposed"].values()) for o in outs),
            "stopped": sum(o.finish_reason == "stop" for o in outs), "seconds": seconds, "elapsed": elapsed}


def _sample(wave: int, requests: int, figures: dict) -> dict:
    """The process's memory and tracked objects after a wave, with the wave's figures."""
    return {"wave": wave, "requests": requests, "rss_mib": rss_bytes() / 2**20, "gc_objects": len(gc.get_objects()),
            **figures}


def growth(samples: list[dict], warmup: int) -> dict:
    """Memory and object counts at the end of the warm-up, their peak after it, and the growth:
    relative for memory, per request served after the warm-up for objects (a leak of one object
    per request is a small fraction of the hundreds of thousands torch and transformers hold)."""
    base, after = samples[warmup - 1], samples[warmup:]
    served = samples[-1]["requests"] - base["requests"]
    out = {}
    for key in ("rss_mib", "gc_objects"):
        peak = max(s[key] for s in after)
        out[f"{key}_first"] = samples[0][key]
        out[f"{key}_warm"] = base[key]
        out[f"{key}_peak_after_warmup"] = peak
        out[f"{key}_final"] = samples[-1][key]
        out[f"{key}_growth"] = (peak - base[key]) / base[key]
    out["gc_objects_per_request"] = (out["gc_objects_peak_after_warmup"] - base["gc_objects"]) / served
    return out


def growth_failures(report: dict, max_growth: float, max_objects_per_request: float) -> list[str]:
    out = []
    g = report["rss_mib_growth"]
    if g > max_growth:
        out.append(f"resident memory grew by {100 * g:.1f}% after the warm-up ({report['rss_mib_warm']:.1f} -> "
                   f"{report['rss_mib_peak_after_warmup']:.1f} MiB), more than {100 * max_growth:.0f}%")
    per = report["gc_objects_per_request"]
    if per > max_objects_per_request:
        out.append(f"objects tracked by the garbage collector grew by {per:.3f} per request after the warm-up "
                   f"({report['gc_objects_warm']} -> {report['gc_objects_peak_after_warmup']}), more than "
                   f"{max_objects_per_request}")
    return out


def plot(report: dict, path: str | os.PathLike) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [s["requests"] for s in report["samples"]]
    fig, axes = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True)
    warm_x = xs[report["warmup_waves"] - 1]
    for ax, key, label in ((axes[0], "rss_mib", "resident memory (MiB)"), (axes[1], "gc_objects", "gc objects")):
        ax.plot(xs, [s[key] for s in report["samples"]], marker=".", lw=1)
        base = report[f"{key}_warm"]
        ax.axhline(base * (1 + report["max_growth"]), color="tab:red", ls="--", lw=1,
                   label=f"+{100 * report['max_growth']:.0f}% of the warm value (fail above)")
        ax.axvspan(0, warm_x, color="0.9", label="warm-up")
        ax.set_ylabel(label)
        ax.legend(loc="lower right", fontsize=8)
    axes[1].set_xlabel("requests completed")
    verdict = "passed" if report["passed"] else "FAILED"
    axes[0].set_title(f"benchmarks.soak: {report['requests']} requests in {report['waves']} waves, {verdict}; "
                      f"rss {100 * report['rss_mib_growth']:+.2f}%", fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = SoakConfig()
    for f in dataclasses.fields(SoakConfig):
        kind = type(f.default) if isinstance(f.default, (float, str)) else int
        ap.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=f.default)
    ap.add_argument("--out", default="bench_results/soak.json", help="the JSON; the PNG goes beside it")
    args = vars(ap.parse_args(argv))
    out = Path(args.pop("out"))
    report = run_soak(dataclasses.replace(defaults, **args))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    plot(report, out.with_suffix(".png"))
    print(f"{report['requests']} requests in {report['seconds']:.1f} s; resident memory {report['rss_mib_warm']:.1f} "
          f"MiB after the warm-up, peak {report['rss_mib_peak_after_warmup']:.1f} MiB after it "
          f"({100 * report['rss_mib_growth']:+.2f}%); gc objects {report['gc_objects_warm']} -> peak "
          f"{report['gc_objects_peak_after_warmup']} ({report['gc_objects_per_request']:+.4f} per request); "
          f"loadavg {report['loadavg'][0]:.2f} (a shared machine)")
    print(f"wrote {out} and {out.with_suffix('.png')}")
    for f in report["failures"]:
        print(f"SOAK FAILED: {f}", file=sys.stderr)
    return report


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
