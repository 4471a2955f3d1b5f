import torch
from rollout.kernels.linear import PackedLinear
torch.manual_seed(0)
for (k, n) in [(512, 512), (512, 256), (256,512), (512,1024), (4864, 896), (896, 4864), (2048, 2048)]:
    layer = PackedLinear(k, n, bias=False).to(torch.bfloat16)
    x = (torch.randn(300, k)*3).to(torch.bfloat16)
    with torch.inference_mode():
        ref = layer(x)
        small = torch.cat([layer(x[i:i+2]) for i in range(0, 300, 2)])
        bad = {}
        for m in list(range(1, 140)) + [150, 200, 256]:
            y = layer(x[:m])
            d = (y != ref[:m]).any(dim=1).sum().item()
            if d: bad[m] = d
        print(k, n, "vs 300-row call:", {m: bad[m] for m in list(bad)[:6]}, "... max m differing", max(bad) if bad else None,
              "| 2-row vs 300:", (small != ref).any(dim=1).sum().item())
