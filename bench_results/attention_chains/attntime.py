import ctypes, time, statistics, torch, sys
sys.path.insert(0, "/work/main/tests/rollout")
from rollout import attention_kernel
from test_kernel_lanes import attend
libs = {t: attention_kernel._bind(ctypes.CDLL(f"/tmp/attention_chains/ak_{t}_16.so")) for t in ("old", "new")}
def case(heads, kv, dim, ctx, slots=64, dtype=torch.float32, per_row=1):
    max_len = 1024; stride = max_len + 16
    k = torch.randn(slots, kv, dim, stride).to(dtype); v = torch.randn(slots, kv, max_len, dim).to(dtype)
    ts = torch.arange(slots).repeat_interleave(per_row); ps = (torch.full((slots,), ctx)[:, None] + torch.arange(per_row)).reshape(-1)
    q = torch.randn(len(ps), heads, dim).to(dtype)
    t = {"old": [], "new": []}
    for r in range(30):
        for name, lib in libs.items():
            s = time.perf_counter(); attend(lib, q, k, v, ts, ps, kv, max_len, stride, 0); t[name].append(time.perf_counter() - s)
    ratio = statistics.median(a / b for a, b in zip(t["new"], t["old"]))
    print(f"heads {heads}/{kv} dim {dim} ctx {ctx} {str(dtype)[6:]} per_row {per_row}: old {statistics.median(t['old'])*1e6/len(ps):.2f} new {statistics.median(t['new'])*1e6/len(ps):.2f} us/token, new/old {ratio:.3f}")
for ctx in (100, 300):
    case(4, 2, 32, ctx)
case(4, 2, 32, 300, per_row=9)
case(4, 2, 32, 300, dtype=torch.bfloat16)
case(14, 2, 64, 300, slots=16)
case(32, 8, 128, 300, slots=8)
case(32, 8, 128, 300, slots=8, dtype=torch.bfloat16)
