"""What spectail adds to vLLM's worker: a weight update that does not restart the engine.

vLLM mixes this class into its worker when the engine is built with
`worker_extension_cls="rollout.vllm_worker.SpectailWorkerExtension"` (a supported option:
vllm/config/parallel.py, `worker_extension_cls`, "used to inject new attributes and methods to
the worker class for use in collective_rpc calls"), and rollout/vllm_backend.py calls its
method through `LLM.collective_rpc`. It is the route TRL's vLLM server
(trl/scripts/vllm_serve.py, `WeightSyncWorkerExtension.update_named_param`), verl
(verl/workers/rollout/vllm_rollout/utils.py, `vLLMColocateWorkerExtension`) and vLLM's own RLHF
example (examples/offline_inference/rlhf_utils.py) take; where they call the model's
`load_weights` directly, this calls the worker's public `reload_weights`
(vllm/v1/worker/gpu_worker.py -> model_loader/reload/inplace.py), which wraps that same
`load_weights` with the layer-wise post-processing quantized layers need.

Runs inside vLLM's worker process; the update was validated before it was sent
(rollout/vllm_weights.py), so every name here is one the model knows.
"""
from __future__ import annotations

import time

from .vllm_weights import unpack


class SpectailWorkerExtension:
    def spectail_load_weights(self, packed) -> dict:
        """Load (name, dtype, shape, bytes) tensors in place; returns what was loaded and how long it took."""
        start = time.perf_counter()
        pairs = unpack(packed, self.model_runner.device)
        self.reload_weights(weights_iterator=iter(pairs), is_checkpoint_format=True)
        return {"tensors": len(pairs), "seconds": time.perf_counter() - start}
