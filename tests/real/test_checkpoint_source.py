"""policy.checkpoint: a local folder (SmolLM2's, its chat template loaded) or a hub id through
transformers' own cache and offline rules; a hub id that cannot load, or chat prompts for a
tokenizer without a chat template, fail by name before any rollout."""
from __future__ import annotations

import os

import huggingface_hub.constants
import pytest

from rl_integration import cli
from rl_integration.dataset import Problem, encode_prompts, write_rows
from rl_integration.demo.policy import load_folder_or_hub

from .conftest import CHATS


def test_a_local_folder_loads_with_its_chat_template(smollm2):
    model, tok, folder = load_folder_or_hub(smollm2)
    assert folder == smollm2 and model.config.num_hidden_layers == 30
    assert tok.chat_template and tok.eos_token_id == 2
    (ids,) = encode_prompts(tok, [Problem(CHATS[0], "")])
    assert tok.decode(ids).endswith("<|im_start|>assistant\n") and "What is the capital of France?" in tok.decode(ids)


def test_a_packaged_models_name_loads_the_folder_spectail_fetch_wrote(smollm2):
    from rl_integration.config import load_config
    from rl_integration.trainer import load_policy

    cfg = load_config(None, ["policy.source=checkpoint", "policy.checkpoint=smollm2"])
    model, tok, folder = load_policy(cfg, progress=False)
    assert folder == smollm2 and model.config.num_hidden_layers == 30 and tok.chat_template


def test_a_hub_id_without_network_names_the_id_and_the_way_out(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # HF_HUB_OFFLINE=1, as read at import
    with pytest.raises(ValueError) as e:
        load_folder_or_hub("HuggingFaceTB/SmolLM2-135M-Instruct")
    msg = str(e.value)
    assert "'HuggingFaceTB/SmolLM2-135M-Instruct' is not a local folder" in msg and "spectail fetch smollm2" in msg
    out = tmp_path / "out"
    rc = cli.main(["train", "--config", os.path.join(os.path.dirname(__file__), "..", "..", "examples", "demo.yaml"),
                   "policy.source=checkpoint", "policy.checkpoint=HuggingFaceTB/SmolLM2-135M-Instruct", "--out",
                   str(out), "--quiet"])
    assert rc == 2 and "spectail fetch smollm2" in capsys.readouterr().err
    assert not (out / "metrics.jsonl").exists()


def test_chat_prompts_for_a_tokenizer_without_template_fail_before_any_rollout(smollm2, tmp_path, capsys):
    ckpt = tmp_path / "no-template"
    ckpt.mkdir()
    for name in os.listdir(smollm2):
        if name != "chat_template.jinja":
            os.symlink(os.path.join(smollm2, name), ckpt / name)
    data = tmp_path / "train.parquet"
    write_rows([{"prompt": CHATS[0], "answer": "Paris"}], data)
    out = tmp_path / "out"
    rc = cli.main(["train", "--config", os.path.join(os.path.dirname(__file__), "..", "..", "examples",
                                                      "grpo_parquet.yaml"),
                   "policy.source=checkpoint", f"policy.checkpoint={ckpt}", f"task.parquet.path={data}",
                   "trainer.prompts_per_step=1", "rollout.n=2", "trainer.steps=1", "--out", str(out), "--quiet"])
    assert rc == 2
    assert "the tokenizer has no chat template" in capsys.readouterr().err
    assert not (out / "metrics.jsonl").exists()
