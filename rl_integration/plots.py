"""One PNG per run, one point per step: reward, rollout throughput (and the plain engine's when --compare
ran), and tokens per target forward. Agg backend, so it works without a display; saved through a temporary
file and a rename, so the PNG on disk is always a whole one."""
from __future__ import annotations

import os

from scheduler.atomic_file import atomic_path


def plot_metrics(records: list[dict], path: str | os.PathLike) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = [r["step"] for r in records]
    fig, (ax_r, ax_t, ax_f) = plt.subplots(1, 3, figsize=(14, 3.6))
    ax_r.plot(steps, [r.get("reward_mean") for r in records], marker="o")
    ax_r.set(xlabel="step", ylabel="mean reward", title="reward")
    ax_r.grid(alpha=0.3)
    ax_t.plot(steps, [r.get("tokens_per_second") for r in records], marker="o", label="spectail")
    if any(r.get("plain_tokens_per_second") is not None for r in records):
        ax_t.plot(steps, [r.get("plain_tokens_per_second") for r in records], marker="s", label="plain engine")
    ax_t.set(xlabel="step", ylabel="tokens / s", title="rollout throughput")
    ax_t.grid(alpha=0.3)
    ax_t.legend()
    # tokens per target forward: what speculation saves, independent of the machine's load
    ax_f.plot(steps, [r.get("accepted_per_verify") for r in records], marker="o", label="spectail")
    ax_f.axhline(1.0, color="gray", linestyle="--", label="plain decoding")
    ax_f.set(xlabel="step", ylabel="tokens / target forward", title="tokens per forward (per request)")
    ax_f.grid(alpha=0.3)
    ax_f.legend()
    for ax in (ax_r, ax_t, ax_f):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    save_figure(fig, path)


def save_figure(fig, path: str | os.PathLike) -> None:
    """Write fig as a PNG through a temporary file and a rename, and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=100, format="png")
    finally:
        plt.close(fig)
