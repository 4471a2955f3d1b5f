"""The engine core: requests, the batch, the KV cache and kept slots, the model, coupled sampling, the Engine."""
