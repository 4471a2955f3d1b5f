"""Our Llama-family model must reproduce transformers' logits, for ragged mixed batches."""
import pytest
import torch
import transformers

from rollout.core.batch import ForwardBatch
from rollout.core.model import CausalLM
from tests.conftest import ARCH_CONFIGS, tiny_hf_model


def run_mixed(model, seqs):
    """Prefill part of each sequence, then one forward mixing a prefill chunk, a one-token
    decode and a multi-token verify row, against distinct, non-contiguous slots."""
    cache = model.new_cache(6, 64)
    cut = [6, 9, 11]
    rows = [(5, 0, seqs[0][:cut[0]]), (0, 0, seqs[1][:cut[1]]), (2, 0, seqs[2][:cut[2]])]
    first, _ = model(ForwardBatch.build(rows, list(range(sum(cut))), "cpu"), cache)
    rows = [(5, cut[0], seqs[0][cut[0]:]), (0, cut[1], seqs[1][cut[1]:]), (2, cut[2], seqs[2][cut[2]:])]
    lens = [len(s) - c for s, c in zip(seqs, cut)]
    second, hidden = model(ForwardBatch.build(rows, list(range(sum(lens))), "cpu"), cache)
    out, a, b = [], 0, 0
    for c, n in zip(cut, lens):
        out.append(torch.cat([first[a:a + c], second[b:b + n]]))
        a, b = a + c, b + n
    return out, hidden


@pytest.mark.parametrize("arch", list(ARCH_CONFIGS))
def test_logits_match_transformers(arch):
    hf = tiny_hf_model(arch, seed=1)
    model = CausalLM.from_pretrained(hf)
    g = torch.Generator().manual_seed(2)
    # lengths chosen so the second forward has a 5-token prefill, a 1-token decode and a 4-token verify
    seqs = [torch.randint(0, 101, (n,), generator=g).tolist() for n in (11, 10, 15)]
    ours, hidden = run_mixed(model, seqs)
    with torch.no_grad():
        for s, o in zip(seqs, ours):
            ref = hf(torch.tensor([s])).logits[0].float()
            assert (o - ref).abs().max().item() < 1e-4
    assert hidden.shape == (10, hf.config.hidden_size)


def test_loads_a_checkpoint_folder(tmp_path):
    hf = tiny_hf_model("qwen2", seed=3)
    hf.save_pretrained(tmp_path)
    model = CausalLM.from_pretrained(str(tmp_path))
    seqs = [list(range(1, 12)), list(range(20, 30)), list(range(40, 55))]
    ours, _ = run_mixed(model, seqs)
    with torch.no_grad():
        ref = hf(torch.tensor([seqs[2]])).logits[0]
    assert (ours[2] - ref).abs().max().item() < 1e-4


def test_sliding_window_matches_transformers():
    hf = tiny_hf_model("mistral", seed=4)
    hf.config.sliding_window = 4
    hf = transformers.MistralForCausalLM(hf.config).eval()
    model = CausalLM.from_pretrained(hf)
    seqs = [list(range(3, 14)), list(range(30, 40)), list(range(50, 65))]
    ours, _ = run_mixed(model, seqs)
    with torch.no_grad():
        for s, o in zip(seqs, ours):
            assert (o - hf(torch.tensor([s])).logits[0]).abs().max().item() < 1e-4


def test_unsupported_architecture_is_named(tmp_path):
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match=r"unsupported architecture 'gpt2'.*llama.*qwen2.*qwen3.*mistral"):
        CausalLM.from_pretrained(gpt2)
    gpt2.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        CausalLM.from_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="no config.json"):
        CausalLM.from_pretrained(str(tmp_path / "nowhere"))


def test_float64_model_matches():
    hf = tiny_hf_model("qwen3", seed=5, dtype=torch.float64)
    model = CausalLM.from_pretrained(hf, dtype=torch.float64)
    seqs = [list(range(1, 12)), list(range(20, 30)), list(range(40, 55))]
    ours, _ = run_mixed(model, seqs)
    with torch.no_grad():
        ref = hf(torch.tensor([seqs[0]])).logits[0]
    assert (ours[0].double() - ref).abs().max().item() < 1e-5


def test_hidden_rows_without_logits():
    """hidden_index returns the final hidden states of any rows (a draft head's features) and the
    logits of logit_index only; lm_head of those hidden states are the same rows' logits."""
    model = CausalLM.from_pretrained(tiny_hf_model("llama", seed=1))
    seq = torch.randint(0, 101, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    all_logits, all_hidden = model(ForwardBatch.build([(0, 0, seq)], list(range(9)), "cpu"), model.new_cache(1, 16))
    logits, hidden = model(ForwardBatch.build([(0, 0, seq)], [8], "cpu", hidden_index=list(range(9))),
                           model.new_cache(1, 16))
    assert logits.shape == (1, 101) and hidden.shape == (9, 48)
    torch.testing.assert_close(hidden, all_hidden)
    torch.testing.assert_close(logits, all_logits[8:])
    with torch.no_grad():
        torch.testing.assert_close(model.lm_head(hidden).float(), all_logits)
