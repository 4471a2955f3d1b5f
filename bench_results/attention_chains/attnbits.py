"""The attention kernel before this change (7f10a00) and after, built at 16 and 8 lanes: the same
bits on 400 random cases (decode tokens, verify rows, chunks; float32 and bfloat16; windows).
Run from the repository root: python bench_results/attention_chains/attnbits.py (then attntime.py, engab.py)."""
import os
os.makedirs("/tmp/attention_chains", exist_ok=True)
os.system("git show 7f10a00:rollout/attention_kernel.c > /tmp/attention_chains/attention_kernel_old.c")
import random, torch, sys, subprocess, ctypes, shutil
sys.path.insert(0, "/work/main/tests/rollout")
from pathlib import Path
from rollout import attention_kernel, c_kernels
from test_kernel_lanes import attend, random_heads
def build(src, tag, lanes):
    out = f"/tmp/attention_chains/ak_{tag}_{lanes}.so"
    r = subprocess.run([c_kernels.compiler(), *c_kernels.FLAGS, f"-DMLANES={lanes}", "-o", out, src], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return attention_kernel._bind(ctypes.CDLL(out))
shutil.copy("/tmp/attention_chains/attention_kernel_old.c", "/work/main/rollout/_old_attention_kernel.c")
try:
    libs = [build("/work/main/rollout/_old_attention_kernel.c", "old", 16), build("/work/main/rollout/attention_kernel.c", "new", 16),
            build("/work/main/rollout/_old_attention_kernel.c", "old", 8), build("/work/main/rollout/attention_kernel.c", "new", 8)]
finally:
    Path("/work/main/rollout/_old_attention_kernel.c").unlink()
rng = random.Random(7)
for case in range(400):
    heads, kv = random_heads(rng, [1, 2, 4, 8, 12, 16])
    dim, max_len, slots = rng.choice([8, 24, 32, 40, 64, 128]), rng.choice([17, 100, 257]), rng.randint(1, 4)
    stride = max_len + rng.choice([0, 16, 37])
    dtype = rng.choice([torch.float32, torch.bfloat16])
    k = (torch.randn(slots, kv, dim, stride) * rng.choice([0.3, 5.0, 50.0])).to(dtype)
    v = torch.randn(slots, kv, max_len, dim).to(dtype)
    window = rng.choice([0, 0, 5, 33])
    ts, ps = [], []
    for _ in range(rng.randint(1, 6)):
        s, m = rng.randrange(slots), rng.choice([1, 1, 1, rng.randint(1, 12)])
        p0 = rng.randint(0, max_len - m)
        ts += [s] * m; ps += range(p0, p0 + m)
    ts, ps = torch.tensor(ts), torch.tensor(ps)
    q = torch.randn(len(ps), heads, dim).to(dtype)
    outs = [attend(l, q, k, v, ts, ps, kv, max_len, stride, window) for l in libs]
    iv = torch.int16 if dtype == torch.bfloat16 else torch.int32
    for o in outs[1:]:
        assert torch.equal(o.view(iv), outs[0].view(iv)), (case, heads, kv, dim, dtype)
print("same bits: 400 cases, old/new at 16 and 8 lanes")
