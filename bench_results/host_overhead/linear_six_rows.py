# Build first: gcc -O3 -march=native -ffp-contract=off -fPIC -shared -std=c11 -o bench_results/host_overhead/lin4.so rollout/linear_kernel.c
#   and the same with -o bench_results/host_overhead/lin6.so bench_results/host_overhead/linear_kernel_six_rows.c
import ctypes, random, time, statistics, torch
import torch.nn.functional as F
def lib(path):
    L = ctypes.CDLL(path); i64, ptr = ctypes.c_int64, ctypes.c_void_p
    L.pack_weight.argtypes = [i64, i64, ptr, ptr]; L.linear_rows.argtypes = [i64, i64, i64, i64, ptr, ptr, ptr, ptr]
    return L
old, new = lib("bench_results/host_overhead/lin4.so"), lib("bench_results/host_overhead/lin6.so")
def run(L, x, w, b):
    n, k = w.shape; packed = torch.empty(-(-n // 16), k, 16); L.pack_weight(n, k, w.data_ptr(), packed.data_ptr())
    out = torch.empty(x.shape[0], n)
    L.linear_rows(0, x.shape[0], k, n, x.data_ptr(), packed.data_ptr(), None if b is None else b.data_ptr(), out.data_ptr())
    return out
rng = random.Random(0); bad = 0
for t in range(300):
    m, k, n = rng.randint(1, 13), rng.choice([1, 7, 64, 128, 200]), rng.choice([1, 5, 16, 17, 64, 100, 102, 256])
    x, w = torch.randn(m, k), torch.randn(n, k); b = torch.randn(n) if rng.random() < 0.5 else None
    a, c = run(old, x, w, b), run(new, x, w, b)
    if not torch.equal(a.view(torch.int32), c.view(torch.int32)): bad += 1
    # a row's bits independent of the rows beside it
    if not torch.equal(run(new, x[:1].contiguous(), w, b).view(torch.int32), c[:1].view(torch.int32)): bad += 1
print("bit differences", bad)
torch.set_num_threads(1)
for m, k, n in ((64, 128, 256), (64, 256, 128), (64, 128, 512), (64, 128, 102), (8, 128, 256), (576, 128, 256), (1, 128, 256)):
    x, w = torch.randn(m, k), torch.randn(n, k)
    packed = torch.empty(-(-n // 16), k, 16); new.pack_weight(n, k, w.data_ptr(), packed.data_ptr()); out = torch.empty(m, n)
    T = {"mkl": [], "4rows": [], "6rows": []}
    for r in range(200):
        t = time.perf_counter(); F.linear(x, w); T["mkl"].append(time.perf_counter() - t)
        t = time.perf_counter(); old.linear_rows(0, m, k, n, x.data_ptr(), packed.data_ptr(), None, out.data_ptr()); T["4rows"].append(time.perf_counter() - t)
        t = time.perf_counter(); new.linear_rows(0, m, k, n, x.data_ptr(), packed.data_ptr(), None, out.data_ptr()); T["6rows"].append(time.perf_counter() - t)
    print((m, k, n), " ".join(f"{a} {min(v)*1e6:.1f}/{statistics.median(v)*1e6:.1f}us ({m*k*n/min(v)/1e9:.1f} GMAC/s)" for a, v in T.items()))
