"""Multi-process TRL: rollouts run on the main process for every process's prompts, as TRL's
vLLM server mode does (trl/generation/vllm_generation.py): gather the prompts, generate, broadcast,
each process keeps its slice (TRL hands every process as many prompts). An error on the main
process is broadcast too and raised everywhere, so none is left waiting in a collective.
"""
from __future__ import annotations

from typing import Callable, Sequence


def gather_generate_scatter(local: Sequence, generate_all: Callable[[list], tuple[dict, dict]],
                            accelerator=None) -> tuple[dict, dict]:
    """generate_all(all prompts) -> (rows: {key: one value per prompt}, shared: {key: value}),
    run on the main process only. Returns this process's rows and the shared values."""
    if accelerator is None or accelerator.num_processes == 1:
        return generate_all(list(local))
    from accelerate.utils import broadcast_object_list, gather_object

    everything = gather_object(list(local))
    payload = [None]
    if accelerator.is_main_process:
        try:
            payload = [("ok", generate_all(everything))]
        except Exception as e:  # every process must leave the broadcast below
            payload = [("error", e)]
    broadcast_object_list(payload, from_process=0)
    status, value = payload[0]
    if status == "error":
        if accelerator.is_main_process:
            raise value
        raise RuntimeError(f"spectail rollout failed on the main process: {type(value).__name__}: {value}")
    rows, shared = value
    start = accelerator.process_index * len(local)
    return {k: v[start:start + len(local)] for k, v in rows.items()}, shared
