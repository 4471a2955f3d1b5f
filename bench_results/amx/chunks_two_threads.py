import torch
torch.manual_seed(0)
def call(packed, x, C):
    n = x.shape[0]; rows = -(-n // C) * C
    if rows != n: x = torch.cat([x, x[:1].expand(rows - n, -1)])
    return torch.cat([torch.ops.mkldnn._linear_pointwise(x[i:i+C], packed, None, "none", [], "") for i in range(0, rows, C)])[:n]
for C in (16, 32, 64):
    res = []
    for (k, n) in [(512, 512), (4864, 896), (896, 4864), (2048, 2048), (8192, 1024), (1024, 8192), (3584, 512)]:
        w = torch.randn(n, k).to(torch.bfloat16) / k**0.5
        packed = torch.ops.mkldnn._reorder_linear_weight(w, C)
        x = (torch.randn(256, k)*3).to(torch.bfloat16)
        with torch.inference_mode():
            torch.set_num_threads(1); a = call(packed, x, C)
            torch.set_num_threads(2); b = call(packed, x, C)
        res.append((k, n, (a != b).any(dim=1).sum().item()))
    print(C, res, flush=True)
