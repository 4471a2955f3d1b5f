"""The CPU kernel for the coupled noise (rollout/noise_kernel.c), built on first use.

In torch the noise takes about twenty passes over a [rows, vocabulary] block, two of them
logarithms, and was a tenth to a fifth of an engine step on the CPU. The kernel makes one pass
per row and keeps no [rows, vocabulary] scratch. It gives bit for bit what sampling.py's torch
reference gives (tests/rollout/test_noise_kernel.py), so which path ran never shows in a token.

The C file is compiled with the system's C compiler into ~/.cache/spectail/kernels (or
$SPECTAIL_KERNEL_DIR), keyed by the source, the flags and the CPU, so a shared home directory
never hands one CPU another's build; processes racing to build it each write their own file and
rename it into place. Without a compiler, or with SPECTAIL_NOISE_KERNEL=0, `load()` is None and
sampling runs the torch reference (a warning says why, once).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch

SOURCE = Path(__file__).with_name("noise_kernel.c")
# -ffp-contract=off: the torch reference rounds each product before it is added.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-std=c11")
MIN_ROWS_PER_THREAD = 4  # fewer rows than this per thread are not worth a thread hand-off


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU's model and flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(lines))


def _library_path(compiler: str) -> Path:
    key = hashlib.sha256("\0".join([SOURCE.read_text(), compiler, *FLAGS, _cpu_identity()]).encode())
    folder = Path(os.environ.get("SPECTAIL_KERNEL_DIR") or Path.home() / ".cache" / "spectail" / "kernels")
    return folder / f"noise_kernel-{key.hexdigest()[:16]}.so"


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, "-o", partial, str(SOURCE)], capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed on {SOURCE.name}: {done.stderr.strip()[-500:]}")
        os.replace(partial, target)  # atomic: a racing process loads either file whole
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def _bind(library: ctypes.CDLL) -> ctypes.CDLL:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.gumbel_rows.argtypes = [i64, i64, i64, ptr, ptr, ptr, ptr]
    library.gumbel_rows.restype = None
    library.perturbed_argmax_rows.argtypes = [i64, i64, i64, ptr, ptr, ptr, ptr, ptr]
    library.perturbed_argmax_rows.restype = None
    return library


@functools.lru_cache(maxsize=1)
def load() -> Optional[ctypes.CDLL]:
    """The kernel library, built if needed; None (and one warning) where it cannot be had."""
    if os.environ.get("SPECTAIL_NOISE_KERNEL", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    try:
        if compiler is None:
            raise RuntimeError("no C compiler on PATH (set CC)")
        target = _library_path(compiler)
        if not target.exists():
            _build(compiler, target)
        return _bind(ctypes.CDLL(str(target)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        warnings.warn(f"spectail: the CPU noise kernel is unavailable ({err}); sampling uses the torch "
                      "reference, which gives the same tokens more slowly", RuntimeWarning, stacklevel=2)
        return None


@functools.lru_cache(maxsize=1)
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="spectail-noise")


def _over_rows(call, rows: int) -> None:
    """call(r0, r1) over [0, rows), split across torch's intra-op thread count (ctypes lets go of
    the GIL during a call). Rows are independent, so the split never changes a value."""
    threads = min(torch.get_num_threads(), rows // MIN_ROWS_PER_THREAD)
    if threads <= 1:
        call(0, rows)
        return
    bounds = [rows * i // threads for i in range(threads + 1)]
    list(_pool(threads).map(call, bounds[:-1], bounds[1:]))


def _rows(seeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (seeds.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous())


def gumbel(library: ctypes.CDLL, seeds: torch.Tensor, positions: torch.Tensor, hv32: torch.Tensor,
           out: torch.Tensor) -> torch.Tensor:
    """out [M, V] float32 (contiguous, CPU) <- G(seed, position, .) of each row; hv32: [V] int32
    vocabulary keys."""
    seeds, positions = _rows(seeds, positions)
    rows, vocab = out.shape
    _over_rows(lambda r0, r1: library.gumbel_rows(r0, r1, vocab, seeds.data_ptr(), positions.data_ptr(),
                                                  hv32.data_ptr(), out.data_ptr()), rows)
    return out


def perturbed_argmax(library: ctypes.CDLL, seeds: torch.Tensor, positions: torch.Tensor, hv32: torch.Tensor,
                     z: torch.Tensor) -> torch.Tensor:
    """argmax(z + G) per row of z [M, V] float32 (contiguous, CPU), as torch.argmax breaks ties."""
    seeds, positions = _rows(seeds, positions)
    rows, vocab = z.shape
    tokens = torch.empty(rows, dtype=torch.int64)
    _over_rows(lambda r0, r1: library.perturbed_argmax_rows(r0, r1, vocab, seeds.data_ptr(), positions.data_ptr(),
                                                            hv32.data_ptr(), z.data_ptr(), tokens.data_ptr()),
               rows)
    return tokens
