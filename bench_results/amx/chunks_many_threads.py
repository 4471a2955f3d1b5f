import torch
torch.manual_seed(0)
def call(packed, x, C):
    n = x.shape[0]; rows = -(-n // C) * C
    if rows != n: x = torch.cat([x, x[:1].expand(rows - n, -1)])
    return torch.cat([torch.ops.mkldnn._linear_pointwise(x[i:i+C], packed, None, "none", [], "") for i in range(0, rows, C)])[:n]
for C in (16, 32):
    res = []
    for (k, n) in [(4864, 896), (8192, 1024), (3584, 512), (8192, 256), (2048, 128)]:
        w = torch.randn(n, k).to(torch.bfloat16) / k**0.5
        packed = torch.ops.mkldnn._reorder_linear_weight(w, C)
        x = (torch.randn(64, k)*3).to(torch.bfloat16)
        with torch.inference_mode():
            torch.set_num_threads(1); a = call(packed, x, C)
            d = []
            for t in (2, 4, 8, 16):
                torch.set_num_threads(t); d.append((call(packed, x, C) != a).any(dim=1).sum().item())
        res.append((k, n, d))
    print(C, res, flush=True)
