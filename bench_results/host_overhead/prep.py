import sys, torch, pickle
exec(open('bench_results/host_overhead/step1_variants.py').read().split("log = {}")[0])
torch.save({k: v.detach().clone() for k, v in hf.state_dict().items()}, "bench_results/host_overhead/w1.pt")
pickle.dump((w1, prompts), open("bench_results/host_overhead/w1.pkl", "wb"))
