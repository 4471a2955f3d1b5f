import os, sys, time, torch
torch.set_num_threads(1)
torch.manual_seed(0)
res = {}
for (k, n) in [(512, 512), (896, 4864), (4864, 896), (2048, 2048)]:
    w = torch.randn(n, k).to(torch.bfloat16) / k**0.5
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 32)
    for m in [2, 16, 64, 512]:
        x = torch.randn(m, k).to(torch.bfloat16)
        with torch.inference_mode():
            f = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            for _ in range(3): f()
            reps = max(3, int(2e8 / (m * k * n)))
            t = time.perf_counter()
            for _ in range(reps): f()
            dt = (time.perf_counter() - t) / reps
        res[(k, n, m)] = dt
        print(k, n, m, f"{dt*1e6:.1f} us  {2*m*k*n/dt/1e9:.1f} GFLOP/s", flush=True)
