"""The seeds of the sampling noise: one 63-bit seed per sample, derived from what identifies it.

The seed is all of a sample's randomness (rollout/core/sampling.py). It depends only on the run seed,
the prompt's identity, the sample's index and (fresh noise) the step, never on where or when it
runs, so every backend and trainer adapter draws the same sample for the same inputs.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Optional, Sequence

MAX_SEED = 2**63


def prompt_key(prompt_ids: Sequence[int]) -> str:
    """Stable identity of a prompt: blake2b-128 of its token ids as int32 little-endian (never
    the decoded text, which different token sequences can share)."""
    ids = [int(t) for t in prompt_ids]
    try:
        data = struct.pack(f"<{len(ids)}i", *ids)
    except struct.error as e:
        raise ValueError(f"prompt token ids must fit in int32: {e}") from None
    return hashlib.blake2b(data, digest_size=16, person=b"spectail-prompt").hexdigest()


def sample_seed(run_seed: int, key: str, sample_index: int, epoch: Optional[int] = None) -> int:
    """A 63-bit seed from (run seed, prompt identity, sample index[, epoch]); stable everywhere.
    epoch None keeps the seed across epochs (per-sample noise); an epoch gives fresh noise."""
    text = f"{int(run_seed)}|{key}|{int(sample_index)}|{'' if epoch is None else int(epoch)}"
    digest = hashlib.blake2b(text.encode(), digest_size=8, person=b"spectail-seed").digest()
    return int.from_bytes(digest, "little") % MAX_SEED
