"""One process: a draft position (8-token chains, 64 requests, context 200) with the fused sampler and with torch's, alternated."""
import time, statistics, types, torch
from drafter.bench import demo_policy
from drafter.head import DraftHead, HeadConfig
from drafter.draft import Chain, draft_chains
from drafter import coupled
from rollout import threads, noise_kernel
from rollout.model import CausalLM
policy = CausalLM.from_pretrained(demo_policy()[2])
head = DraftHead.for_policy(policy, HeadConfig(window=64), dtype=torch.float32, seed=0)
batch, ctx = 64, 200
hc = head.new_cache(batch, ctx + 8, max_draft=8)
feats = torch.randn(batch, policy.cfg.hidden_size)
c8 = [Chain(i, ctx, [5 + i % 50], feats[i:i + 1], i, ctx, 8) for i in range(batch)]
c1 = [Chain(i, ctx, [5 + i % 50], feats[i:i + 1], i, ctx, 1) for i in range(batch)]
off = types.SimpleNamespace(load=lambda: None)
res = {("fused", 8): [], ("torch", 8): [], ("fused", 1): [], ("torch", 1): []}
with threads.using(1):
    for r in range(25):
        for path in ("fused", "torch"):
            coupled.noise_kernel = noise_kernel if path == "fused" else off
            for k, cs in ((8, c8), (1, c1)):
                t = time.perf_counter(); d = draft_chains(head, policy, hc, cs, margins=True); res[(path, k)].append(time.perf_counter() - t)
coupled.noise_kernel = noise_kernel
for k in (8, 1):
    f, t = res[("fused", k)], res[("torch", k)]
    print(f"k={k}: fused median {statistics.median(f)*1e3/k:.3f} ms/position (min {min(f)*1e3/k:.3f}), torch {statistics.median(t)*1e3/k:.3f} (min {min(t)*1e3/k:.3f}); fused/torch median of ratios {statistics.median(a/b for a,b in zip(f,t)):.3f}")
import os; print("load", os.getloadavg())
