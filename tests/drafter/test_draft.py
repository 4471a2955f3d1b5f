"""The engine's way of running the head (ragged rows against its KV cache, one draft position per
batched forward) drafts exactly what the unrolled simulation says, including after rollbacks."""
import pytest
import torch

from drafter import head_kernel
from drafter.draft import Chain, draft_chains
from drafter.head import DraftHead, HeadConfig
from drafter.head_cache import Rows
from drafter.simulate import chain_runs


@pytest.fixture(params=["kernel", "torch"])
def attention_path(request, monkeypatch):
    """The head's cached attention through drafter/head_kernel.c (where it runs) or torch's ops."""
    if request.param == "torch":
        monkeypatch.setattr(head_kernel, "supports", lambda *a: False)
    elif head_kernel.load() is None:
        pytest.skip("no C compiler: the head's attention kernel cannot be built")
    return request.param


def run_of(draft, target):
    n = 0
    while n < len(draft) and n < len(target) and draft[n] == target[n]:
        n += 1
    return n


def chain_at(r, f, t, k, slot, start=0):
    """The chain whose pending token is response position t; rows from `start` are (re)written."""
    p = len(r.prompt_ids) - 1 + t  # the pending token's row
    ids = r.token_ids
    return Chain(slot=slot, start=start, tokens=ids[start + 1:p + 2], feats=f[start:p + 1], seed=r.seed,
                 position=t + 1, k=k, temperature=r.temperature, top_k=r.top_k, top_p=r.top_p)


@pytest.mark.parametrize("kind,window", [("attention", None), ("attention", 5), ("mlp", None)])
def test_batched_cached_chains_match_the_simulation(policy, rollouts, kind, window, attention_path):
    rolls, feats = rollouts
    head = DraftHead.for_policy(policy, HeadConfig(kind=kind, window=window), seed=5)
    want = chain_runs(head, policy, rolls, max_k=6, features=feats)
    assert sum(run for per in want for run, _ in per) > 100  # long runs: the comparison has teeth
    cache = head.new_cache(len(rolls), 128)
    for t in range(0, 30, 3):  # every request at once, each at response position t, k by request
        idx = [i for i, r in enumerate(rolls) if t < len(r.response_ids) - 1]
        chains = [chain_at(rolls[i], feats[i], t, want[i][t][1], slot=i) for i in idx]
        drafts = draft_chains(head, policy, cache, chains, margins=True)
        for i, d in zip(idx, drafts):
            assert len(d.tokens) == want[i][t][1]
            assert run_of(d.tokens, rolls[i].response_ids[t + 1:]) == want[i][t][0]
            assert all(m >= 0 for m in d.margins)


@pytest.mark.parametrize("window", [None, 3])
def test_engine_walk_with_rollback_matches_the_simulation(policy, rollouts, window, attention_path):
    """Walk each response as the engine would: after a verify the next chain rewrites the rows
    from the first one whose input was a draft (stale keys beyond it are never read)."""
    rolls, feats = rollouts
    head = DraftHead.for_policy(policy, HeadConfig(window=window), seed=5)
    want = chain_runs(head, policy, rolls, max_k=5, features=feats)
    cache = head.new_cache(2, 128, max_draft=5)  # a window's ring of 8 rows: it wraps many times
    walked = 0
    for i, (r, f) in enumerate(zip(rolls[:12], feats[:12])):
        t, start = 0, 0
        while t < len(r.response_ids) - 1:
            k = min(5, len(r.response_ids) - 1 - t)
            d = draft_chains(head, policy, cache, [chain_at(r, f, t, k, slot=i % 2, start=start)])[0]
            run = run_of(d.tokens, r.response_ids[t + 1:])
            assert (run, k) == want[i][t]
            start = len(r.prompt_ids) + t  # the first row fed a draft token
            t += run + 1
            walked += 1
    assert walked > 50


def test_bfloat16_head_runs_both_ways(policy, rollouts):
    rolls, feats = rollouts
    head = DraftHead.for_policy(policy, HeadConfig(), dtype=torch.bfloat16, seed=5)
    runs = chain_runs(head, policy, rolls[:4], max_k=3, features=feats[:4])
    assert all(0 <= run <= n for per in runs for run, n in per)
    d = draft_chains(head, policy, head.new_cache(1, 128), [chain_at(rolls[0], feats[0], 2, 3, slot=0)])[0]
    assert len(d.tokens) == 3 and all(0 <= x < policy.cfg.vocab_size for x in d.tokens)


def test_bad_chain_is_refused(policy, rollouts):
    rolls, feats = rollouts
    head = DraftHead.for_policy(policy, HeadConfig(kind="mlp"), seed=5)
    bad = Chain(slot=0, start=0, tokens=[1, 2], feats=feats[0][:1], seed=1, position=1, k=2)
    with pytest.raises(ValueError, match="one feature row per token"):
        draft_chains(head, policy, None, [bad])
    attn = DraftHead.for_policy(policy, HeadConfig(), seed=5)
    far = Chain(slot=0, start=30, tokens=[1, 2], feats=feats[0][:2], seed=1, position=1, k=4)
    with pytest.raises(ValueError, match="do not fit the head's cache"):
        draft_chains(attn, policy, attn.new_cache(1, 32), [far])


def test_a_window_changes_what_the_head_sees(policy, rollouts):
    """The window is real: with a short one the same weights give other outputs on long rows."""
    rolls, feats = rollouts
    full = DraftHead.for_policy(policy, HeadConfig(), seed=5)
    short = DraftHead.for_policy(policy, HeadConfig(window=2), seed=5)
    short.load_state_dict(full.state_dict())
    tokens, f = torch.tensor([rolls[0].token_ids[1:]]), feats[0][None, :-1]
    a, b = full.unroll(policy, tokens, f, 1)[0][0], short.unroll(policy, tokens, f, 1)[0][0]
    torch.testing.assert_close(a[:, :2], b[:, :2])  # the first rows see no more than 2 keys either way
    assert not torch.allclose(a[:, 5:], b[:, 5:])


@pytest.mark.parametrize("window", [None, 4])
def test_attention_kernel_matches_torch(policy, window, monkeypatch):
    """Ragged catch-up rows in scattered slots, then one row per request twice (a ring of 4 + 2
    rows wraps): the kernel writes the same keys and values and attends within float rounding."""
    if head_kernel.load() is None:
        pytest.skip("no C compiler: the head's attention kernel cannot be built")
    head = DraftHead.for_policy(policy, HeadConfig(window=window), seed=3)
    cfg = head.cfg
    caches = {"kernel": head.new_cache(8, 64, max_draft=2)}
    with monkeypatch.context() as m:
        m.setattr(head_kernel, "supports", lambda *a: False)
        caches["torch"] = head.new_cache(8, 64, max_draft=2)
    assert caches["kernel"].keys_transposed and not caches["torch"].keys_transposed
    gen = torch.Generator().manual_seed(0)
    slots, starts, lens = [6, 1, 3], [0, 0, 0], [9, 1, 5]
    steps = [(starts, lens), ([9, 1, 5], [1, 1, 1]), ([10, 2, 6], [1, 1, 1])]
    for begin, counts in steps:
        n = sum(counts)
        qkv = torch.randn(n, cfg.num_heads + 2 * cfg.num_kv_heads, cfg.head_dim, generator=gen)
        got = {}
        for path, cache in caches.items():
            tokens = [[0] * c for c in counts]
            rows = Rows.build(slots, begin, tokens, torch.zeros(n, policy.cfg.hidden_size), "cpu", cache)
            got[path] = cache.attend_rows(qkv, cfg.num_heads, rows)
        assert got["kernel"].shape == (3, cfg.num_heads * cfg.head_dim)
        torch.testing.assert_close(got["kernel"], got["torch"], rtol=1e-5, atol=1e-6)
    # every written row holds the same key and value bits in both (a kernel ring keeps whole vectors of rows)
    kernel, plain = caches["kernel"], caches["torch"]
    for slot, end in zip(slots, (11, 3, 7)):
        for p in range(max(0, end - (window or end) + 1), end):
            a, b = p % kernel.rows_kept, p % plain.rows_kept
            assert torch.equal(kernel.k[slot, :, :, a], plain.k[slot, :, b]), (slot, p)
            assert torch.equal(kernel.v[slot, :, a], plain.v[slot, :, b]), (slot, p)
