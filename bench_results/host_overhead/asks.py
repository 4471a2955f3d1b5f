import sys, time, pickle, torch, collections
exec(open('bench_results/host_overhead/hostab.py').read().split("acc = [0.0]")[0])
from rollout import controller as C
asks = collections.Counter(); wins = collections.Counter(); found = collections.Counter(); nonempty = collections.Counter()
orig_ask = C.AdaptiveController._ask
def _ask(self, proposer, req, k):
    d = orig_ask(self, proposer, req, k)
    asks[proposer.name] += 1
    if d is not None and d.tokens: found[proposer.name] += 1
    return d
C.AdaptiveController._ask = _ask
orig_choose = C.AdaptiveController.choose
def choose(self, req, room, plan, free=0):
    d = orig_choose(self, req, room, plan, free)
    if d is not None: wins[d.proposer.name] += 1
    return d
C.AdaptiveController.choose = choose
e.generate(w1["prompts"], w1["params"], seeds=w1["seeds"], drafts=w1["drafts"], groups=w1["groups"], draft_logprobs=w1["draft_lps"])
print("asks", dict(asks)); print("found", dict(found)); print("wins", dict(wins))
