"""The C kernels' bits do not depend on the machine's vector width.

Lane-wise arithmetic runs in `mvec` (MLANES floats: 16 where the CPU has AVX-512, 8 elsewhere,
rollout/kernels/kernel_math.h) and sums across lanes keep LANES = 16 partial sums, so an AVX2 machine and
an AVX-512 one sample the same tokens. Both widths are built here, on this machine, from the same
source, and must agree bit for bit on random inputs (float32 and bfloat16 caches, windows, verify
rows and lone tokens, head sizes that are not a multiple of either width). The linear kernel's
vector path (AVX-512 or AVX2) must give the bits of its one-output-at-a-time fallback: one fused
multiply-add chain per output.
"""
from __future__ import annotations

import ctypes
import random
import subprocess

import pytest
import torch

from drafter import head_kernel
from rollout.kernels import attention_kernel, c_kernels, linear_kernel


def build(source, lanes: int, folder, *flags: str) -> ctypes.CDLL:
    cc = c_kernels.compiler()
    if cc is None:
        pytest.skip("no C compiler here")
    target = folder / f"{source.stem}-{lanes}{''.join(flags)}.so"
    done = subprocess.run([cc, *c_kernels.FLAGS, f"-DMLANES={lanes}", *flags, "-o", str(target), str(source)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-800:]
    return ctypes.CDLL(str(target))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def agree(outs, case) -> None:
    """Finite outputs of the same bits."""
    assert torch.isfinite(outs[0].float()).all(), case
    for out in outs[1:]:
        assert torch.equal(bits(outs[0]), bits(out)), case


def random_heads(rng: random.Random, choices) -> tuple[int, int]:
    """(query heads, key/value heads dividing them)."""
    heads = rng.choice(choices)
    return heads, rng.choice([h for h in (1, 2, 4) if heads % h == 0])


def attend(library, q, k, v, token_slots, positions, kv, max_len, stride, window) -> torch.Tensor:
    out, (n, heads, dim) = torch.empty_like(q), q.shape
    assert library.attend_tokens(0, n, heads, kv, dim, max_len, stride, int(q.dtype == torch.bfloat16), q.data_ptr(),
                                 k.data_ptr(), v.data_ptr(), token_slots.data_ptr(), positions.data_ptr(), window,
                                 dim ** -0.5, out.data_ptr()) == 0
    return out


def head_attend(library, qkv, heads, kv, dim, kept, window, cos, sin, token_slots, positions, k, v) -> torch.Tensor:
    out = torch.zeros(qkv.shape[0], heads * dim)
    assert library.head_attend_rows(0, qkv.shape[0], heads, kv, dim, kept, window, dim ** -0.5, qkv.data_ptr(),
                                    cos.data_ptr(), sin.data_ptr(), None, token_slots.data_ptr(),
                                    positions.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()) == 0
    return out


def test_attention_has_the_same_bits_at_both_vector_widths(tmp_path):
    libraries = [attention_kernel._bind(build(c_kernels.HERE / "attention_kernel.c", n, tmp_path)) for n in (8, 16)]
    rng = random.Random(0)
    for _ in range(60):
        heads, kv = random_heads(rng, [2, 4, 8, 12])
        dim, max_len, slots = rng.choice([8, 24, 32, 40, 64]), rng.choice([17, 100, 257]), rng.randint(1, 4)
        stride = max_len + rng.choice([0, 16, 37])
        dtype = rng.choice([torch.float32, torch.bfloat16])
        k = (torch.randn(slots, kv, dim, stride) * rng.choice([0.3, 5.0, 50.0])).to(dtype)
        v = torch.randn(slots, kv, max_len, dim).to(dtype)
        window = rng.choice([0, 0, 5, 33])
        token_slots, positions = [], []
        for _ in range(rng.randint(1, 6)):  # runs of consecutive positions: verify rows, chunks, lone tokens
            s, m = rng.randrange(slots), rng.randint(1, 12)
            p0 = rng.randint(0, max_len - m)
            token_slots += [s] * m
            positions += range(p0, p0 + m)
        token_slots, positions = torch.tensor(token_slots), torch.tensor(positions)
        q = torch.randn(len(positions), heads, dim).to(dtype)
        agree([attend(library, q, k, v, token_slots, positions, kv, max_len, stride, window) for library in libraries],
              (heads, kv, dim, max_len, window, dtype))


def test_the_draft_heads_attention_has_the_same_bits_at_both_vector_widths(tmp_path):
    libraries = [head_kernel._bind(build(head_kernel.HERE / "head_kernel.c", n, tmp_path)) for n in (8, 16)]
    rng = random.Random(1)
    for _ in range(60):
        heads, kv = random_heads(rng, [1, 2, 4, 8])
        dim, kept, slots, n = rng.choice([8, 24, 32, 40, 64]), rng.choice([16, 64, 128]), rng.randint(1, 4), 8
        window = rng.choice([0, 7, 16, 40])
        window = window if window <= kept else 0
        positions = torch.tensor([rng.randrange(4 * kept if window else kept) for _ in range(n)])
        token_slots = torch.tensor([rng.randrange(slots) for _ in range(n)])
        qkv = torch.randn(n, (heads + 2 * kv) * dim) * rng.choice([0.3, 5.0, 40.0])
        cos, sin = torch.randn(int(positions.max()) + 1, dim), torch.randn(int(positions.max()) + 1, dim)
        k, v = torch.randn(slots, kv, dim, kept), torch.randn(slots, kv, kept, dim)
        agree([head_attend(library, qkv, heads, kv, dim, kept, window, cos, sin, token_slots, positions, k, v)
               for library in libraries], (heads, kv, dim, kept, window))


def test_the_linear_kernels_vector_path_has_the_bits_of_its_fallback(tmp_path):
    source = c_kernels.HERE / "linear_kernel.c"
    vector = linear_kernel._bind(build(source, 16, tmp_path))
    if not vector.linear_vectorized():
        pytest.skip("this CPU has neither AVX-512 nor AVX2 with FMA: the fallback is the only path")
    fallback = linear_kernel._bind(build(source, 16, tmp_path, "-mno-avx512f", "-mno-avx2"))
    assert not fallback.linear_vectorized()
    rng = random.Random(2)
    for _ in range(80):
        rows, k, n = rng.randint(1, 11), rng.choice([1, 7, 64, 130]), rng.choice([1, 5, 16, 17, 70, 102])
        x, w = torch.randn(rows, k), torch.randn(n, k)
        bias = torch.randn(n) if rng.random() < 0.5 else None
        reference = x @ w.T + (0 if bias is None else bias)
        outs = [linear_kernel.linear(lib, linear_kernel.pack(lib, w), n, x, bias) for lib in (vector, fallback)]
        assert torch.allclose(outs[0], reference, atol=1e-4, rtol=1e-4)
        agree(outs, (rows, k, n, bias is None))
