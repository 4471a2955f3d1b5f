"""bfloat16 matmuls on the CPU without AMX, so a row gets the same bits whatever call computes it.

On a CPU with AMX (Intel Xeon from Sapphire Rapids on, where the kernel lets a process use its
tiles) oneDNN runs bfloat16 matmuls on AMX tiles and chooses its kernel, its blocking and, on
several threads, whether to split the sum, by the call's row count: a row computed in a decode of
3 requests, in a verify step or in a prefill of 300 tokens then differs in its last bits, and
speculation or the batch size changes tokens (tests/rollout/test_bf16_identity.py fails). Running
every call in fixed-size chunks of rows gives the same bits on one thread, but not on many when
the weight has few outputs (oneDNN then splits the sum between threads). oneDNN's AVX-512 BF16
kernels gave a row the same bits at every row count and thread count tried (docs/dtypes.md).

The engine's linear layers reach AMX through a kernel of our own that keeps a row's bits
(rollout/amx_linear.py); the cap keeps torch's other bfloat16 matmuls exact.

`cap_isa` caps oneDNN at AVX512_CORE_BF16 (`ONEDNN_MAX_CPU_ISA`), unless the user chose a cap of
their own. Importing spectail does not call it: `rollout.cpu.configure()` does, where spectail owns
the process (its command line, its Ray workers) or when a user asks. oneDNN reads the variable
once, when it creates its first kernel, so the cap holds only if nothing in the process ran a
oneDNN matmul before. The cost: torch's own bfloat16 matmuls of many rows run several times
slower than on AMX; float32, the CPU's default dtype, never runs on AMX and is unchanged; a GPU
is not concerned. An engine in bfloat16 on the CPU whose linear layers would run through oneDNN
(the tile kernel unusable) checks, once per process, that oneDNN gives rows the same bits
(`rows_invariant`), and warns when it does not.
"""
from __future__ import annotations

import functools
import os
import warnings

# torch is imported inside the functions: `rollout.cpu.configure()` runs this module's `cap_isa`
# before torch is loaded.

ISA_VARS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")  # oneDNN reads either (the second is its old name)
CAP = "AVX512_CORE_BF16"


def cap_isa() -> None:
    """Cap oneDNN below AMX, unless the user set a cap. No effect once oneDNN made a kernel."""
    if not any(v in os.environ for v in ISA_VARS):
        os.environ[ISA_VARS[0]] = CAP


def uncapped(env) -> dict:
    """The variables to set for a process that is not spectail's engine (vLLM's), so that it runs
    at its own best, AMX included, where the cap in `env` is the one set here. "ALL" lifts
    oneDNN's limit, and `cap_isa` leaves it alone should that process configure spectail."""
    return {ISA_VARS[0]: "ALL"} if env.get(ISA_VARS[0]) == CAP else {}


@functools.lru_cache(maxsize=1)
def rows_invariant() -> bool:
    """Whether this process's oneDNN gives a bfloat16 row the same bits in a call of 128 rows as
    in calls of 2 (False where it runs on AMX). True where oneDNN cannot run bfloat16 at all
    (torch's own matmul then runs it)."""
    import torch

    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return True
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(512, 1024, generator=g) / 32).to(torch.bfloat16)
    x = (torch.randn(128, 1024, generator=g) * 3).to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 32)

    def run(rows):
        return torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [], "")

    with torch.inference_mode():
        return torch.equal(run(x), torch.cat([run(x[i:i + 2]) for i in range(0, 128, 2)]))


def check(dtype, device) -> None:
    """Warn when an engine in bfloat16 on the CPU would compute rows with call-dependent bits:
    where oneDNN runs on AMX and the engine's linear layers go through it (no AMX kernel of ours)."""
    import torch

    if dtype != torch.bfloat16 or torch.device(device).type != "cpu" or rows_invariant():
        return
    from . import amx_linear

    if amx_linear.load() is not None:
        return
    warnings.warn(f"bfloat16 on this CPU: oneDNN runs AMX kernels ({_why_uncapped()}), whose bits for a row "
                  f"depend on how many rows a call holds, so speculation and the batch size may change tokens. "
                  f"Call rollout.cpu.configure() before any torch matmul (or set {ISA_VARS[0]}={CAP} in the "
                  f"environment), or use float32 (rollout/cpu_isa.py).", RuntimeWarning, stacklevel=3)


def _why_uncapped() -> str:
    chosen = {v: os.environ[v] for v in ISA_VARS if os.environ.get(v, CAP) != CAP}
    if chosen:
        return f"the environment sets {chosen}"
    if os.environ.get(ISA_VARS[0]) == CAP:
        return "oneDNN made a kernel before the cap was set"
    return "no cap set: rollout.cpu.configure() was not called"
