"""oneDNN capped below AMX, so a bfloat16 row gets the same bits whatever call computes it
(docs/dtypes.md): on AMX oneDNN chooses its kernel and split of the sum by the call's row count.
`cap_isa` runs from `rollout.cpu.configure()` (never on import) and holds only if no oneDNN
matmul ran before; the engine's linear layers reach AMX through rollout/kernels/amx_linear.py instead,
and an engine whose layers would go through an uncapped oneDNN warns (`check`).
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
    """The variables that lift our cap (set in `env`) for a process that is not spectail's engine
    (vLLM's), so it runs at its best, AMX included; `cap_isa` leaves "ALL" alone."""
    return {ISA_VARS[0]: "ALL"} if env.get(ISA_VARS[0]) == CAP else {}


@functools.lru_cache(maxsize=1)
def rows_invariant() -> bool:
    """Whether this process's oneDNN gives a bfloat16 row the same bits in a call of 128 rows as in
    calls of 2 (False on AMX; True where oneDNN runs no bfloat16)."""
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
                  f"environment), or use float32 (rollout/kernels/cpu_isa.py).", RuntimeWarning, stacklevel=3)


def _why_uncapped() -> str:
    chosen = {v: os.environ[v] for v in ISA_VARS if os.environ.get(v, CAP) != CAP}
    if chosen:
        return f"the environment sets {chosen}"
    if os.environ.get(ISA_VARS[0]) == CAP:
        return "oneDNN made a kernel before the cap was set"
    return "no cap set: rollout.cpu.configure() was not called"
