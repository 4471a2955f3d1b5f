"""C kernels for the CPU, compiled on first use with the system's C compiler.

Each kernel is one C file beside the module that binds it (rollout/kernels/*_kernel.c, drafter/head_kernel.c),
compiled into ~/.cache/spectail/kernels (or $SPECTAIL_KERNEL_DIR), keyed by the source, the flags
and the CPU (a shared home never hands one CPU another's build); racing builds each write their
own file and rename it into place. Without a compiler, or with SPECTAIL_C_KERNELS=0, `load` is
None (and says why, once) and the caller runs its torch code. ctypes lets go of the GIL, so
`over_rows` can split rows across threads.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional

import torch

HERE = Path(__file__).parent
# -ffp-contract=off: products are rounded before they are added, as in the torch code they mirror.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-std=c11")
MIN_ROWS_PER_THREAD = 4  # fewer rows than this per thread are not worth a thread hand-off
I64, PTR, INT, FLOAT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float


def binder(**signatures: tuple) -> Callable[[ctypes.CDLL], ctypes.CDLL]:
    """A `bind` for `load`: name=(restype, argtypes) for each function of the library."""
    def bind(library: ctypes.CDLL) -> ctypes.CDLL:
        for name, (restype, argtypes) in signatures.items():
            function = getattr(library, name)
            function.restype, function.argtypes = restype, argtypes
        return library

    return bind


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU's model and flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(lines))


def _sources(source: Path) -> list[str]:
    """The C file's text and that of each header it includes by a quoted path (one level)."""
    text = source.read_text()
    headers = re.findall(r'^#include "([^"]+)"', text, flags=re.MULTILINE)
    return [text, *((source.parent / h).read_text() for h in headers)]


def _library_path(source: Path, compiler: str) -> Path:
    key = hashlib.sha256("\0".join([*_sources(source), compiler, *FLAGS, _cpu_identity()]).encode())
    folder = Path(os.environ.get("SPECTAIL_KERNEL_DIR") or Path.home() / ".cache" / "spectail" / "kernels")
    return folder / f"{source.stem}-{key.hexdigest()[:16]}.so"


def _build(compiler: str, source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, "-o", partial, str(source)], capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed on {source.name}: {done.stderr.strip()[-500:]}")
        os.replace(partial, target)  # atomic: a racing process loads either file whole
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def compiler() -> Optional[str]:
    """The C compiler the kernels are built with: $CC, else cc, gcc or clang on PATH; None: none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


@functools.cache
def load(name: str, bind: Callable[[ctypes.CDLL], ctypes.CDLL], folder: Path = HERE) -> Optional[ctypes.CDLL]:
    """<folder>/<name>.c as a library, built if needed and bound by `bind`; None (one warning) if not."""
    if os.environ.get("SPECTAIL_C_KERNELS", "1") == "0":
        return None
    cc = compiler()
    try:
        if cc is None:
            raise RuntimeError("no C compiler on PATH (set CC)")
        source = Path(folder) / f"{name}.c"
        target = _library_path(source, cc)
        if not target.exists():
            _build(cc, source, target)
        return bind(ctypes.CDLL(str(target)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        warnings.warn(f"spectail: the CPU kernel {name} is unavailable ({err}); the engine runs its torch code, "
                      "which gives the same tokens more slowly", RuntimeWarning, stacklevel=3)
        return None


@functools.lru_cache(maxsize=1)
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="spectail-kernel")


def over_rows(call: Callable[[int, int], object], rows: int) -> list:
    """call(r0, r1) over [0, rows), split across torch's intra-op thread count. Rows are
    independent in every kernel, so the split never changes a value."""
    threads = min(torch.get_num_threads(), rows // MIN_ROWS_PER_THREAD)
    if threads <= 1:
        return [call(0, rows)]
    bounds = [rows * i // threads for i in range(threads + 1)]
    return list(_pool(threads).map(call, bounds[:-1], bounds[1:]))
