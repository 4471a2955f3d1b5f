import torch, sys
from rollout.kernels.linear import PackedLinear
torch.manual_seed(0)
dt = getattr(torch, sys.argv[1])
for (k, n) in [(512, 512), (4864, 896), (896, 4864), (2048, 2048)]:
    layer = PackedLinear(k, n, bias=False).to(dt)
    x = (torch.randn(300, k)*3).to(dt)
    with torch.inference_mode():
        torch.set_num_threads(1); a = layer(x); a7 = layer(x[:7])
        torch.set_num_threads(2); b = layer(x); c = layer(x[:7])
    print(sys.argv[1], k, n, "300 rows 1 vs 2 threads:", (a != b).any(dim=1).sum().item(), " 7 rows:", (c != a7).any(dim=1).sum().item())
