"""The sampler's memory at a real vocabulary: without the C kernel (a GPU, or a CPU without a
compiler) the noise is made in bounded row chunks, so sampling 576 rows of a 152k vocabulary
needs less than a quarter of the logits' size beyond them, and gives the kernel's tokens."""
import os
import subprocess
import sys

import torch

from rollout.config import SamplingParams
from rollout.core import sampling

ROWS, VOCAB = 576, 151_936  # a 64-request verify step of 9 tokens each, Qwen2's vocabulary
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = f"""
import resource, sys, torch
from rollout.core import sampling
from rollout.kernels import noise_kernel
from rollout.config import SamplingParams
assert noise_kernel.load() is None  # the torch path
torch.set_num_threads(1)
rows, vocab = {ROWS}, {VOCAB}
logits = torch.empty(rows, vocab).normal_(generator=torch.Generator().manual_seed(0)).mul_(3.0)
seeds, positions = torch.arange(rows) * 7919 + 11, torch.arange(rows) % 9
params = sampling.sampling_tensors([SamplingParams(temperature=1.0)] * rows, "cpu")
sampling.sample(logits[:2], seeds[:2], positions[:2], *(p[:2] for p in params))  # torch's lazy set-up, once
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
tokens, logprobs = sampling.sample(logits, seeds, positions, *params)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
torch.save((tokens, logprobs), sys.argv[1])
print((after - before) * 1024, logits.numel() * 4)
"""


def test_the_torch_path_samples_a_large_vocabulary_in_bounded_memory_with_the_kernels_tokens(tmp_path):
    out = tmp_path / "tokens.pt"
    env = {**os.environ, "SPECTAIL_C_KERNELS": "0", "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(out)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    extra, logits_bytes = map(int, proc.stdout.split()[-2:])
    assert extra < logits_bytes / 4, f"{extra / 2**20:.0f} MiB beyond {logits_bytes / 2**20:.0f} MiB of logits"
    tokens, logprobs = torch.load(out)
    # the same rows through this process's sampler (the C kernel where it builds): the same bits
    logits = torch.empty(ROWS, VOCAB).normal_(generator=torch.Generator().manual_seed(0)).mul_(3.0)
    seeds, positions = torch.arange(ROWS) * 7919 + 11, torch.arange(ROWS) % 9
    params = sampling.sampling_tensors([SamplingParams(temperature=1.0)] * ROWS, "cpu")
    expected_tokens, expected_logprobs = sampling.sample(logits, seeds, positions, *params)
    assert torch.equal(tokens, expected_tokens) and torch.equal(logprobs, expected_logprobs)


def test_an_accelerators_chunks_hold_a_bounded_share_of_the_logits():
    # (no GPU needed: the chunking is a pure function of the shape and the device type)
    chunks = list(sampling._row_chunks(ROWS, VOCAB, torch.device("cuda")))
    assert chunks[0][0] == 0 and chunks[-1][1] == ROWS
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    widest = max(r1 - r0 for r0, r1 in chunks)
    scratch_bytes_per_element = 36  # two int64 hash buffers, float64 u, float32 noise, z, log_softmax
    assert widest * VOCAB * scratch_bytes_per_element < ROWS * VOCAB * 4 / 4
    assert len(list(sampling._row_chunks(3, 10 * sampling._DEVICE_CHUNK_ELEMENTS, torch.device("cuda")))) == 3
