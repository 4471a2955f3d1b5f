import torch, time
torch.manual_seed(0); torch.set_num_threads(1)
def call(packed, x, C):
    n = x.shape[0]; rows = -(-n // C) * C
    if rows != n: x = torch.cat([x, x[:1].expand(rows - n, -1)])
    return torch.cat([torch.ops.mkldnn._linear_pointwise(x[i:i+C], packed, None, "none", [], "") for i in range(0, rows, C)])[:n]
for C in [16, 32, 64]:
    out = []
    for (k, n) in [(512, 512), (512, 1024), (4864, 896), (896, 4864), (2048, 2048), (512, 101), (256, 512)]:
        w = torch.randn(n, k).to(torch.bfloat16) / k**0.5
        packed = torch.ops.mkldnn._reorder_linear_weight(w, C)
        x = (torch.randn(320, k)*3).to(torch.bfloat16)
        with torch.inference_mode():
            ref = call(packed, x, C)
            bad = [m for m in list(range(1, 140)) + [150, 200, 256] if (call(packed, x[:m], C) != ref[:m]).any()]
            # a row at another position
            sh = call(packed, x[5:45], C)
            bad2 = (sh != ref[5:45]).any(dim=1).sum().item()
        out.append((k, n, len(bad), bad2))
    print("chunks of", C, out, flush=True)
