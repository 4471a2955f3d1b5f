"""The drafter's coupled sampler gives the same draft tokens and margins through the CPU noise
kernel (one pass per row) as through torch's ops (the noise made in blocks, then added): which
path ran never shows in a draft or in the confidence read from its margin."""
import pytest
import torch

from drafter import coupled
from drafter.draft import Chain
from rollout.kernels import noise_kernel


def chains(n, temperature=1.0, top_k=0, top_p=1.0, greedy_at=None):
    feats = torch.zeros(1, 4)
    return [Chain(slot=i, start=0, tokens=[1], feats=feats, seed=1000 + 7 * i, position=3 + i, k=5,
                  temperature=0.0 if i == greedy_at else temperature, top_k=top_k, top_p=top_p)
            for i in range(n)]


def drafts(cs, logits, live, monkeypatch, kernel: bool):
    """Tokens and margins of `cs` at steps 0-2, each step with a shrinking set of live chains."""
    if not kernel:
        monkeypatch.setattr(noise_kernel, "load", lambda: None)
    sampler, out = coupled.CoupledSampler(cs, "cpu"), []
    for step, rows in enumerate(live):
        index = None if len(rows) == len(cs) else torch.tensor(rows)
        toks, picked, gaps = sampler.draft(logits[step][rows], rows, step, True, index)
        assert toks.tolist() == picked
        out.append((picked, gaps))
    monkeypatch.undo()
    return out


@pytest.mark.parametrize("params", [{}, {"temperature": 0.7, "top_k": 20}, {"top_p": 0.8}, {"greedy_at": 2}])
def test_the_kernel_drafts_what_torch_drafts(params, monkeypatch):
    if noise_kernel.load() is None:
        pytest.skip("no C compiler: the noise kernel cannot be built")
    vocab, n = 300, 12
    gen = torch.Generator().manual_seed(3)
    logits = [torch.randn(n, vocab, generator=gen) * 4 for _ in range(3)]
    logits[0][5, :] = logits[0][5, 0]  # one row of equal logits: ties
    cs = chains(n, **params)
    live = [list(range(n)), [0, 2, 3, 7, 11], [2, 11]]
    got = drafts(cs, logits, live, monkeypatch, kernel=True)
    want = drafts(cs, logits, live, monkeypatch, kernel=False)
    assert [t for t, _ in got] == [t for t, _ in want]
    torch.testing.assert_close(torch.tensor([g for _, gs in got for g in gs]),
                               torch.tensor([g for _, gs in want for g in gs]), rtol=0, atol=0)
    assert len(set(t for ts, _ in got for t in ts)) > 5  # the noise, not the logits alone, picks
