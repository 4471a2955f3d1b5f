"""Plain engine, old vs new attention kernel alternated in one process (the library swapped)."""
import ctypes, time, statistics, sys, torch, transformers, os
from rollout import attention_kernel, Engine, EngineConfig, SamplingParams
from rollout.model import CausalLM
old = attention_kernel._bind(ctypes.CDLL("/tmp/attention_chains/ak_old_16.so"))
new_load = attention_kernel.load
which = sys.argv[1]
if which == "demo":
    from drafter.bench import demo_policy
    pol = CausalLM.from_pretrained(demo_policy()[2]); dtype = "float32"
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, 100, (int(torch.randint(20, 40, (1,), generator=g)),), generator=g).tolist() for _ in range(128)]
    batch, max_tokens = 64, 400
else:
    dtype = which
    cfg = transformers.LlamaConfig(vocab_size=16000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048)
    torch.manual_seed(0); m = transformers.LlamaForCausalLM(cfg).eval()
    pol = CausalLM.from_pretrained(m, getattr(torch, dtype), "cpu")
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, 16000, (32,), generator=g).tolist() for _ in range(64)]
    batch, max_tokens = 32, 256
e = Engine(pol, EngineConfig(max_batch_size=batch, max_model_len=1024, dtype=dtype, num_threads=1))
p = SamplingParams(temperature=1.0, max_tokens=max_tokens)
seeds = list(range(len(ids)))
t = {"old": [], "new": []}; outs = {}
for r in range(int(sys.argv[2])):
    for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
        attention_kernel.load = (lambda: old) if name == "old" else new_load
        s = time.process_time(); o = e.generate(ids, p, seeds=seeds); t[name].append(time.process_time() - s)
        outs[name] = [x.token_ids for x in o]
assert outs["old"] == outs["new"]
toks = sum(len(x) for x in outs["new"])
print(which, f"old {statistics.median(t['old']):.3f}s new {statistics.median(t['new']):.3f}s ({toks} tokens); new/old median of ratios {statistics.median(a / b for a, b in zip(t['new'], t['old'])):.3f}, min/min {min(t['new'])/min(t['old']):.3f}; load {os.getloadavg()}")
