"""The drafter on a real checkpoint: warm start, simulated acceptance per draft position, and the
cost of a draft position next to a decode step (issue 47's measurements).

    python -m benchmarks.bench_drafter_real --policy /work/smol-f32 --work /tmp/smolbench

Stages, each cached in --work so a rerun continues: (1) the warm start of a head with a draft
vocabulary (drafter/checkpoint_warm_start.py: the policy's own T = 1 samples of reasoning_gym
chain_sum questions through the chat template), whose samples are kept; (2) a full-vocabulary
head trained on the same samples for the same seconds; (3) held-out samples (other questions);
(4) the exact offline acceptance of both heads per draft position (drafter/simulate.py); (5) the
seconds of one draft position of 16 chains (draft_chains with k = 9 less k = 1, over 8) against
one decode forward of the policy for 16 rows at a context of --context tokens, plus its sampling.
Run it on one thread (OMP_NUM_THREADS=1): a shared machine's figures are noisy, so each time is
the median of --repeats.
"""
from __future__ import annotations

import argparse
import json
import pickle
import statistics
import time
from pathlib import Path

import torch

from drafter import checkpoint_warm_start as cws
from drafter.draft import Chain, draft_chains
from drafter.features import sequence_features
from drafter.head import DraftHead, HeadConfig
from drafter.simulate import simulated_acceptance
from drafter.warm_start import warm_start
from rollout.core import sampling
from rollout.core.batch import ForwardBatch
from rollout.core.model import CausalLM


def chat_prompts(folder: str, n: int, seed: int) -> tuple[list[list[int]], int]:
    """n chain_sum questions through the tokenizer's chat template, and its EOS id."""
    import reasoning_gym
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    out = []
    for x in reasoning_gym.create_dataset("chain_sum", size=n, seed=seed):
        ids = tok.apply_chat_template([{"role": "user", "content": x["question"]}], add_generation_prompt=True,
                                      tokenize=True)
        out.append([int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)])
    return out, int(tok.eos_token_id)


# where rollout's modules were before it was split into rooms (issue 46): a head pickled in a --work
# folder before then names its layers' classes by the old paths
_MOVED = {"rollout.model": "rollout.core.model", "rollout.linear": "rollout.kernels.linear",
          "rollout.kv_cache": "rollout.core.kv_cache", "rollout.batch": "rollout.core.batch"}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        return super().find_class(_MOVED.get(module, module), name)


def unpickle(path: Path):
    with open(path, "rb") as f:
        return _Unpickler(f).load()


def cached(path: Path, make):
    if path.exists():
        return unpickle(path)
    value = make()
    path.write_bytes(pickle.dumps(value))
    return value


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: packs, kernels
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def decode_step_seconds(policy: CausalLM, rows: int, context: int, repeats: int) -> dict:
    """One decode forward of `rows` requests at position `context` (logits for each), and the
    coupled sampling of those rows over the whole vocabulary."""
    cache = policy.new_cache(rows, context + 8)
    batch = ForwardBatch.build([(i, context, [100 + i]) for i in range(rows)], list(range(rows)), "cpu")
    logits = policy(batch, cache)[0]
    seeds, pos = torch.arange(rows), torch.full((rows,), context)
    ones, zeros = torch.ones(rows), torch.zeros(rows, dtype=torch.int64)
    with torch.inference_mode():
        fwd = median_seconds(lambda: policy(batch, cache), repeats)
        smp = median_seconds(lambda: sampling.sample(logits, seeds, pos, ones, zeros, ones), repeats)
    return {"forward_s": fwd, "sample_s": smp, "step_s": fwd + smp}


def draft_position_seconds(head, policy: CausalLM, rows: int, context: int, repeats: int) -> float:
    """(draft_chains of k = 9) - (k = 1), over 8: one more draft position of `rows` chains."""
    d = policy.cfg.hidden_size
    cache = head.new_cache(rows, context + 16, max_draft=16)

    def chains(k):
        return [Chain(slot=i, start=context - 1, tokens=[100 + i], feats=torch.randn(1, d), seed=i,
                      position=context, k=k) for i in range(rows)]

    one, nine = chains(1), chains(9)
    t1 = median_seconds(lambda: draft_chains(head, policy, cache, one), repeats)
    t9 = median_seconds(lambda: draft_chains(head, policy, cache, nine), repeats)
    return (t9 - t1) / 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", default="/work/smol-f32")
    ap.add_argument("--work", default="/tmp/smolbench")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--budget", type=float, default=300.0)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--held-out", type=int, default=8)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--stages", default="warm,full,held,accept,cost")
    a = ap.parse_args()
    torch.set_num_threads(1)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    stages = set(a.stages.split(","))
    policy = CausalLM.from_pretrained(a.policy)
    results_path = work / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}

    def save():
        results_path.write_text(json.dumps(results, indent=2))

    prompts, eos = chat_prompts(a.policy, a.prompts, seed=1)
    recipe = cws.Recipe(samples=a.samples, max_tokens=a.max_tokens, time_budget_s=a.budget, batch=64)
    captured, captured_feats = [], []
    sample = cws.sample_own_rollouts

    def keep(*args, **kw):
        rolls, feats = sample(*args, **kw)
        captured.extend(rolls)
        captured_feats.extend(feats)
        return rolls, feats

    cws.sample_own_rollouts = keep
    sub_cfg = HeadConfig(window=64, draft_vocab=a.draft_vocab)
    t0 = time.perf_counter()
    sub, folder, report = cws.load_or_warm_start_for(policy, prompts, [eos], sub_cfg, recipe, cache_dir=str(work),
                                                     num_threads=1)
    if captured:
        (work / "train_rollouts.pkl").write_bytes(pickle.dumps(captured))
        torch.save(captured_feats, work / "train_features.pt")
        results["warm_start"] = {**{k: v for k, v in report.items() if isinstance(v, (int, float, str, bool))},
                                 "wall_s": time.perf_counter() - t0, "folder": str(folder)}
        save()
    print("warm start:", results.get("warm_start"), flush=True)
    train = unpickle(work / "train_rollouts.pkl")
    full_path = work / "full_head.pkl"
    if "full" in stages and not full_path.exists():
        seconds = results["warm_start"].get("seconds", 150.0)
        feats = torch.load(work / "train_features.pt") if (work / "train_features.pt").exists() else None
        full, _, rep = warm_start(policy, train, HeadConfig(window=64), time_budget_s=seconds,
                                  train_config=cws.TrainConfig(decay="cosine", num_threads=1), features=feats)
        full_path.write_bytes(pickle.dumps(full))
        results["full_train"] = {k: v for k, v in rep.items() if isinstance(v, (int, float, str, bool))}
        save()
    full = unpickle(full_path) if full_path.exists() else None
    held_prompts, _ = chat_prompts(a.policy, a.held_out, seed=2)
    held = cached(work / "held_rollouts.pkl", lambda: sample(
        policy, held_prompts, [eos], cws.Recipe(samples=2, max_tokens=a.max_tokens, seed=7), 1e9, 1)[0])
    if "accept" in stages:
        feats = sequence_features(policy, [r.token_ids for r in held])
        for name, head in (("sub", sub), ("full", full)):
            if head is not None:
                s = simulated_acceptance(head, policy, held, 8, feats)
                results[f"acceptance_{name}"] = {"by_position": s["by_position"],
                                                 "first": s["first_token_acceptance"],
                                                 "per_token_k8": s["per_token_acceptance"],
                                                 "tokens_per_forward_k8": s["by_k"][8]["tokens_per_forward"],
                                                 "chain_starts": s["chain_starts"]}
                print(name, results[f"acceptance_{name}"], flush=True)
        save()
    if "cost" in stages:
        step = decode_step_seconds(policy, 16, a.context, a.repeats)
        cost = {"decode": step}
        small = DraftHead.for_policy(policy, HeadConfig(window=64, draft_vocab=a.draft_vocab // 2), seed=0)
        for name, head in (("sub", sub), ("full", full), (f"sub{a.draft_vocab // 2}", small)):
            if head is not None:
                pos = draft_position_seconds(head, policy, 16, a.context, a.repeats)
                cost[name] = {"position_s": pos, "of_forward": pos / step["forward_s"], "of_step": pos / step["step_s"]}
        results["cost_batch16"] = cost
        print(cost, flush=True)
        save()


if __name__ == "__main__":
    main()
