"""What spectail adds to vLLM's worker (vLLM's `worker_extension_cls` option, called through
`LLM.collective_rpc`, the route TRL and verl take): a weight update without a restart, through the
worker's public `reload_weights`, which adds the post-processing quantized layers need. Runs
inside vLLM's worker; the update was validated before it was sent (rollout/vllm_backend/weights.py).
"""
from __future__ import annotations

import time

from .weights import unpack


class SpectailWorkerExtension:
    def spectail_load_weights(self, packed) -> dict:
        """Load (name, dtype, shape, bytes) tensors in place."""
        start = time.perf_counter()
        pairs = unpack(packed, self.model_runner.device)
        self.reload_weights(weights_iterator=iter(pairs), is_checkpoint_format=True)
        return {"tensors": len(pairs), "seconds": time.perf_counter() - start}
