"""The draft vocabulary (drafter/vocab.py): a head over a token subset S drafts exactly what a
full-vocabulary draft picks from logits that are -inf outside S (each real id keeps its own noise),
its logits are the index-selected full logits of the policy's live lm_head, and it trains, exports
and drafts through the engine's path like a full head."""
import pytest
import torch

from drafter import coupled
from drafter.draft import Chain, draft_chains
from drafter.export import export, load
from drafter.features import row_batch
from drafter.head import DraftHead, HeadConfig
from drafter.simulate import chain_runs
from drafter.trainer import TrainConfig, batch_loss
from drafter.vocab import expand, frequent_tokens
from drafter.warm_start import warm_start
from rollout.core import sampling
from rollout.kernels import noise_kernel

from .test_draft import chain_at, run_of


def _paths(monkeypatch, kernel: bool):
    if kernel and noise_kernel.load() is None:
        pytest.skip("no C compiler: the noise kernel cannot be built")
    if not kernel:
        monkeypatch.setattr(noise_kernel, "load", lambda: None)


def _chains(n, temperature=1.0, top_k=0, top_p=1.0):
    return [Chain(slot=i, start=0, tokens=[1], feats=torch.zeros(1, 4), seed=77 + 13 * i, position=2 + i, k=3,
                  temperature=temperature, top_k=top_k, top_p=top_p) for i in range(n)]


@pytest.mark.parametrize("kernel", [True, False])
def test_subset_noise_is_the_full_noise_of_those_ids(kernel, monkeypatch):
    _paths(monkeypatch, kernel)
    ids = torch.tensor([0, 3, 4, 17, 250, 299])
    seeds, positions = torch.tensor([5, 2 ** 40 + 3, 9]), torch.tensor([0, 7, 123])
    want = sampling.gumbel_noise(seeds, positions, 300)[:, ids]
    assert torch.equal(sampling.gumbel_noise(seeds, positions, 300, ids), want)


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("params", [{}, {"temperature": 0.7, "top_k": 5}, {"top_p": 0.9}])
def test_subset_draft_is_the_full_draft_with_minus_inf_outside(kernel, params, monkeypatch):
    _paths(monkeypatch, kernel)
    vocab, n = 300, 16
    gen = torch.Generator().manual_seed(4)
    ids = torch.randperm(vocab, generator=gen)[:40].sort().values
    sub = [torch.randn(n, 40, generator=gen) * 3 for _ in range(3)]
    sub[0][3, :] = sub[0][3, 0]  # a row of equal logits: ties break as over the full vocabulary
    cs = _chains(n, **params)
    got_s = coupled.CoupledSampler(cs, "cpu", ids, vocab)
    got_f = coupled.CoupledSampler(cs, "cpu")
    seen = set()
    for step, live in enumerate([list(range(n)), [0, 3, 5, 15], [5]]):
        index = None if len(live) == n else torch.tensor(live)
        toks, picked, gaps = got_s.draft(sub[step][live], live, step, True, index)
        want_toks, want_picked, want_gaps = got_f.draft(expand(sub[step][live], ids, vocab), live, step, True, index)
        assert picked == want_picked and toks.tolist() == picked
        assert torch.equal(torch.tensor(gaps), torch.tensor(want_gaps))
        assert set(picked) <= set(ids.tolist())
        seen |= set(picked)
    assert len(seen) > 5  # the noise, not the logits alone, picks


def test_frequent_tokens_ranks_by_count_then_fills_the_lowest_ids():
    seqs = [[9, 9, 9, 4, 4, 7], [7, 7, 2, 5]]  # 9: 3, 7: 3, 4: 2, 2: 1, 5: 1
    assert frequent_tokens(seqs, size=4, vocab_size=20).tolist() == [2, 4, 7, 9]  # 2 before 5 (lower id)
    assert frequent_tokens(seqs, size=7, vocab_size=20).tolist() == [0, 1, 2, 4, 5, 7, 9]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        frequent_tokens([[25]], size=2, vocab_size=20)
    with pytest.raises(ValueError, match="draft vocabulary size"):
        frequent_tokens(seqs, size=21, vocab_size=20)


def sub_head(policy, rolls, size=40, **cfg):
    head = DraftHead.for_policy(policy, HeadConfig(draft_vocab=size, **cfg), seed=5)
    head.set_draft_vocab(frequent_tokens([r.response_ids for r in rolls], size, policy.cfg.vocab_size))
    return head


def test_sub_logits_are_the_selected_full_logits_of_the_live_lm_head(policy, rollouts):
    head = sub_head(policy, rollouts[0])
    out = torch.randn(7, policy.cfg.hidden_size)
    ids = head.draft_vocab
    with torch.no_grad():  # the packed kernel's way
        torch.testing.assert_close(head.logits(policy, out), head.full_logits(policy, out)[:, ids])
    torch.testing.assert_close(head.logits(policy, out), head.full_logits(policy, out)[:, ids])  # autograd's
    w = policy.lm_head.weight
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            w.mul_(0.5)  # the policy trained: the cached gather must follow
        with torch.no_grad():
            torch.testing.assert_close(head.logits(policy, out), head.full_logits(policy, out)[:, ids])
    finally:
        with torch.no_grad():
            w.copy_(saved)
    assert head.logits(policy, out).shape == (7, 40)


def test_a_draft_vocabulary_of_every_id_trains_as_the_full_head(policy, rollouts):
    rolls, feats = rollouts
    full = DraftHead.for_policy(policy, HeadConfig(), seed=5)
    every = DraftHead.for_policy(policy, HeadConfig(draft_vocab=policy.cfg.vocab_size), seed=5)
    rb = row_batch(rolls[:6], feats[:6])
    a, kl_a = batch_loss(full, policy, rb, TrainConfig())
    b, kl_b = batch_loss(every, policy, rb, TrainConfig())
    torch.testing.assert_close(a, b)
    assert kl_a == pytest.approx(kl_b, rel=1e-5, abs=1e-6)


def test_sub_vocabulary_chains_match_the_simulation(policy, rollouts):
    """The engine's way (cached rows, CoupledSampler over S) drafts what the simulation (the
    full-vocabulary sampler on logits spread with -inf) says, and only ids of S."""
    rolls, feats = rollouts
    head = sub_head(policy, rolls)
    want = chain_runs(head, policy, rolls, max_k=5, features=feats)
    assert sum(run for per in want for run, _ in per) > 50
    cache = head.new_cache(len(rolls), 128)
    allowed = set(head.draft_vocab.tolist())
    for t in range(0, 24, 4):
        idx = [i for i, r in enumerate(rolls) if t < len(r.response_ids) - 1]
        drafts = draft_chains(head, policy, cache, [chain_at(rolls[i], feats[i], t, want[i][t][1], slot=i)
                                                    for i in idx])
        for i, d in zip(idx, drafts):
            assert run_of(d.tokens, rolls[i].response_ids[t + 1:]) == want[i][t][0]
            assert set(d.tokens) <= allowed


def test_sub_vocabulary_head_learns_and_exports(policy, rollouts, tmp_path):
    rolls, feats = rollouts
    head = sub_head(policy, rolls)
    before = _acceptance(head, policy, rolls, feats)
    head, _, report = warm_start(policy, rolls, head=head, time_budget_s=60, max_steps=60)
    after = _acceptance(head, policy, rolls, feats)
    assert after > before + 0.1, (before, after, report)
    back = load(export(head, tmp_path / "h"), policy)
    assert torch.equal(back.draft_vocab, head.draft_vocab) and back.cfg.draft_vocab == 40
    out = torch.randn(3, policy.cfg.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(back.logits(policy, out), head.logits(policy, out))


def test_bad_draft_vocabularies_are_refused(policy, tmp_path):
    with pytest.raises(ValueError, match="exceeds the policy's vocabulary"):
        DraftHead.for_policy(policy, HeadConfig(draft_vocab=policy.cfg.vocab_size + 1))
    head = DraftHead.for_policy(policy, HeadConfig(draft_vocab=4))
    with pytest.raises(ValueError, match="strictly increasing"):
        head.set_draft_vocab(torch.tensor([3, 1, 2, 5]))
    with pytest.raises(ValueError, match="config says 4"):
        head.set_draft_vocab(torch.tensor([1, 2, 3]))
    folder = export(head, tmp_path / "h")
    from safetensors.torch import load_file, save_file
    w = load_file(str(folder / "model.safetensors"))
    w["draft_vocab"] = torch.tensor([0, 1, 1, 2])
    save_file(w, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="draft_vocab"):
        load(folder, policy)


def _acceptance(head, policy, rolls, feats):
    runs = chain_runs(head, policy, rolls, max_k=1, features=feats)
    flat = [r for per in runs for r, _ in per]
    return sum(flat) / len(flat)


def test_the_engine_drafts_with_a_sub_vocabulary_head_and_tokens_stay_plain(policy, rollouts):
    from drafter.proposer import DrafterProposer
    from rollout import Engine, EngineConfig, SamplingParams, SpecConfig
    from rollout.config import DrafterSpec

    rolls, _ = rollouts
    head, _, _ = warm_start(policy, rolls, head=sub_head(policy, rolls), max_steps=30, time_budget_s=60.0)
    prompts = [r.prompt_ids for r in rolls[:10]]
    params = [SamplingParams(temperature=1.0, max_tokens=30), SamplingParams(temperature=0.7, top_k=9, max_tokens=30)]
    params = [params[i % 2] for i in range(10)]
    seeds = list(range(500, 510))
    ref = Engine(policy, EngineConfig(max_batch_size=4, max_model_len=96)).generate(prompts, params, seeds)
    eng = Engine(policy, EngineConfig(max_batch_size=4, max_model_len=96,
                                      spec=SpecConfig(proposers=("drafter",), min_draft_prob=0.0,
                                                                    drafter=DrafterSpec())))
    DrafterProposer.of(eng).set_head(head, 1)
    out = eng.generate(prompts, params, seeds)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert sum(o.stats["proposed"].get("drafter", 0) for o in out) > 0  # (a fixed floor of 0: it always drafts)
