"""Coupled sampling: every token is argmax(z/T + G(seed, t, .)) over the kept tokens.

The one invariant of spectail (DESIGN.md): G is a counter-based hash of (seed, t, v), so a token
is a pure function of its row's logits, seed, position and params; nothing here may let one row
depend on another, the batch or the chunking (that is what lets the engine verify drafts by
comparison). The hash is 32-bit integer work held in int64 with multipliers in (-2**31, 2**31),
so no product overflows; the row state absorbs seed and t by invertible `_mix32` steps; then
u = (x + 1/2) / 2**32, E = -log(u) in float64 (accurate as u -> 1, where rare tokens win) and
G = -log(E). Both logarithms are `_log_positive` (integer work and correctly rounded arithmetic),
not the device's `log`, so every device and the CPU kernel (rollout/kernels/noise_kernel.c, through
rollout/kernels/ops.py) give the same bits. Off that kernel the [M, V] work runs in bounded row chunks.
"""
from __future__ import annotations

import functools
from typing import Callable, Iterator, Optional, Sequence

import torch

from ..kernels import noise_kernel, ops

_M32 = 0xFFFFFFFF
# lowbias32 multipliers (Chris Wellons' hash-prospector). _C2 >= 2**31, so it is stored as
# its negative twin mod 2**32: |x * c| < 2**63 for x < 2**32, hence no int64 overflow.
_C1 = 0x7FEB352D
_C2 = 0x846CA68B - (1 << 32)
# Distinct odd constants keep the seed halves, positions and vocabulary in different
# "lanes" and avoid the fixed point _mix32(0) == 0.
_K_SEED_LO = 0x243F6A88
_K_SEED_HI = 0x85A308D3
_K_VOCAB = 0x13198A2E

_TWO_POW_M32 = 2.0 ** -32
_TWO_POW_M33 = 2.0 ** -33
# Elements per chunk: the torch path's scratch is nine times the float32 logits, so whole batches
# of a large vocabulary would need gigabytes. A CPU chunk's scratch stays in cache; an accelerator
# takes bigger chunks (fewer launches). Chunking never changes a value.
_CPU_CHUNK_ELEMENTS = 1 << 19
_DEVICE_CHUNK_ELEMENTS = 1 << 21
# top-k / top-p first rank only this many of each row's largest logits, then this many,
# then the whole row (see _top_k_top_p).
_TOP_CANDIDATES = (64, 4096)


# --------------------------------------------------------------------------------- hashing

def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 finalizer on 32-bit values held in int64; a bijection of [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * _C1) & _M32
    x = x ^ (x >> 15)
    x = (x * _C2) & _M32
    return x ^ (x >> 16)


def _row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M] seeds and positions -> two [M, 1] 32-bit keys (a 64-bit row state), by invertible steps."""
    seeds = seeds.to(torch.int64)
    positions = positions.to(device=seeds.device, dtype=torch.int64)
    # The masks make the halves well defined for any int64 (negative values are read as
    # their two's-complement bits), since >> on int64 is an arithmetic shift.
    a = _mix32((seeds & _M32) ^ _K_SEED_LO)
    b = _mix32(((seeds >> 32) & _M32) ^ _K_SEED_HI)
    a = _mix32(a ^ b)
    b = _mix32(b ^ a)
    a = _mix32(a ^ (positions & _M32))
    b = _mix32(b ^ ((positions >> 32) & _M32) ^ a)
    a = _mix32(a ^ b)
    return a[:, None], b[:, None]


def _row_keys_to(device: torch.device, seeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """_row_keys computed where the seeds lie (the host: on an accelerator each small op would be a
    launch), then both keys copied to `device` at once."""
    a, b = _row_keys(seeds, positions)
    if a.device == device:
        return a, b
    keys = torch.cat((a, b), dim=1).to(device)
    return keys[:, :1], keys[:, 1:]


@functools.lru_cache(maxsize=8)
def _vocab_keys(vocab_size: int, device: torch.device) -> torch.Tensor:
    """[1, V] per-token keys: a bijective scramble of the token id (cached, read-only)."""
    v = torch.arange(vocab_size, dtype=torch.int64, device=device)
    return _mix32(v ^ _K_VOCAB)[None, :]


def _row_chunks(num_rows: int, vocab_size: int, device: torch.device) -> Iterator[tuple[int, int]]:
    """Row ranges of at most a chunk's elements (one row at the least)."""
    elements = _CPU_CHUNK_ELEMENTS if device.type == "cpu" else _DEVICE_CHUNK_ELEMENTS
    step = max(1, elements // max(1, vocab_size))
    for r0 in range(0, num_rows, step):
        yield r0, min(num_rows, r0 + step)


def _scratch(rows: int, vocab_size: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Reused buffers for one chunk: hash state, shift temporary, float64 u."""
    x = torch.empty(rows, vocab_size, dtype=torch.int64, device=device)
    return x, torch.empty_like(x), torch.empty(rows, vocab_size, dtype=torch.float64, device=device)


def _f32_quotient(a: float, b: float) -> float:
    """a / b divided in float32 (as C's 1.0f / 11.0f), as a Python float that holds it exactly."""
    return float(torch.tensor(a, dtype=torch.float32) / b)


# log m = 2 atanh(s) = 2 s (1 + s^2/3 + s^4/5 + ...), highest power first; ln 2 = HI + LO with
# e * HI exact. The float32 coefficients are float32 divisions, as the C file's 1.0f / 11.0f.
_LOG_F64 = (tuple(1.0 / n for n in range(21, 0, -2)), float.fromhex("0x1.6a09e667f3bcdp+0"),
            float.fromhex("0x1.62e42feep-1"), float.fromhex("0x1.a39ef35793c76p-33"))
_LOG_F32 = (tuple(_f32_quotient(1.0, n) for n in range(11, 0, -2)), float.fromhex("0x1.6a09e6p+0"),
            float.fromhex("0x1.62e3p-1"), float.fromhex("0x1.2fefa2p-17"))


def _log_positive(x: torch.Tensor) -> torch.Tensor:
    """log x (x positive, normal, float64 or float32) by rollout/kernels/noise_kernel.c's arithmetic, integer work
    and correctly rounded +, -, *, / only: x = 2^e m, s = (m - 1) / (m + 1), log m = 2 atanh(s)."""
    wide = x.dtype == torch.float64
    int_type, shift, bias, mantissa, one = ((torch.int64, 52, 1023, 0x000FFFFFFFFFFFFF, 0x3FF0000000000000) if wide
                                            else (torch.int32, 23, 127, 0x007FFFFF, 0x3F800000))
    coefficients, sqrt2, ln2_hi, ln2_lo = _LOG_F64 if wide else _LOG_F32
    bits = x.view(int_type)
    m = ((bits & mantissa) | one).view(x.dtype)
    big = m > sqrt2
    m = torch.where(big, m * 0.5, m)
    e = ((bits >> shift) - bias + big.to(int_type)).to(x.dtype)
    f = m - 1.0
    s = f / (f + 2.0)
    s2 = s * s
    p = torch.full_like(s2, coefficients[0])
    for c in coefficients[1:]:
        p = p * s2 + c
    t = s * p
    return e * ln2_hi + ((t + t) + e * ln2_lo)


def _log_exponential_(a: torch.Tensor, b: torch.Tensor, hv: torch.Tensor,
                      out: torch.Tensor, scratch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """out [m, V] <- log(E), E = -log(u) ~ Exp(1) (G = -log E), from row keys a, b [m, 1] and vocabulary
    keys hv [1, V], hashed in place on the scratch: the reference the CPU kernel matches bit for bit."""
    m = out.shape[0]
    x, tmp, u = (s[:m] for s in scratch)
    torch.bitwise_xor(a, hv, out=x)
    # first half of _mix32
    x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=tmp))
    x.mul_(_C1).bitwise_and_(_M32)
    # the second 32 bits of the row state enter here, so every element sees all 64
    x.bitwise_xor_(b)
    # second half of _mix32
    x.bitwise_xor_(torch.bitwise_right_shift(x, 15, out=tmp))
    x.mul_(_C2).bitwise_and_(_M32)
    x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=tmp))
    # u = (x + 1/2) / 2**32: exact in float64 (x < 2**32), never 0 nor 1
    u.copy_(x).mul_(_TWO_POW_M32).add_(_TWO_POW_M33)
    # log u in [-22.9, -1.2e-10], in float64 so that E = -log u keeps its digits near u = 1;
    # then to float32: E's relative precision is all G needs
    out.copy_(_log_positive(u)).neg_()
    return out.copy_(_log_positive(out))


@functools.lru_cache(maxsize=8)
def vocab_keys32(vocab_size: int) -> torch.Tensor:
    """[V] int32: the CPU vocabulary keys with the kernel's 32-bit layout (the same bits)."""
    return _vocab_keys(vocab_size, torch.device("cpu"))[0].to(torch.int32).contiguous()


def gumbel_noise(seeds: torch.LongTensor, positions: torch.LongTensor, vocab_size: int,
                 ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """G(seed, t, v) ~ Gumbel(0, 1), i.i.d. over distinct (seed, t, v). [M], [M] -> [M, V] float32
    on the seeds' device. seeds: int64 in [0, 2**63); positions: response positions t (0-based).
    ids: only these columns (a draft vocabulary's sorted ids: [M, |ids|], the same bits)."""
    seeds = torch.as_tensor(seeds, dtype=torch.int64)
    device = seeds.device
    m, width = seeds.shape[0], vocab_size if ids is None else ids.numel()
    out = torch.empty(m, width, dtype=torch.float32, device=device)
    if out.numel() == 0:
        return out
    positions = torch.as_tensor(positions, device=device)
    kernel = ops.noise_library(device)
    if kernel is not None:
        keys = vocab_keys32(vocab_size) if ids is None else vocab_keys32(vocab_size)[ids.cpu()].contiguous()
        return noise_kernel.gumbel(kernel, seeds, positions, keys, out)
    a, b = _row_keys(seeds, positions)
    hv = _vocab_keys(vocab_size, device) if ids is None else _vocab_keys(vocab_size, device)[:, ids.to(device)]
    chunks = list(_row_chunks(m, width, device))
    scratch = _scratch(max(r1 - r0 for r0, r1 in chunks), width, device)
    for r0, r1 in chunks:
        _log_exponential_(a[r0:r1], b[r0:r1], hv, out[r0:r1], scratch).neg_()
    return out


# -------------------------------------------------------------------------- logit processing

def process_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor) -> torch.Tensor:
    """[M, V] logits -> [M, V] float32: z / T for kept tokens, -inf for dropped ones. T == 0 rows use
    T = 1 here (sampled greedily); top_k 0 or >= V and top_p 1 are off. top-k keeps the k largest,
    ties to the lower id; top-p then keeps the smallest sorted prefix of what top-k kept
    (renormalised) reaching top_p, at least the top token."""
    logits = logits.to(torch.float32)
    device = logits.device
    vocab_size = logits.shape[-1]
    temperature = temperature.to(device=device, dtype=torch.float32)
    top_k = top_k.to(device=device, dtype=torch.int64)
    top_p = top_p.to(device=device, dtype=torch.float32)

    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    z = logits / t[:, None]  # always a new tensor: callers may keep `logits`
    filtered = ((top_k > 0) & (top_k < vocab_size)) | (top_p < 1)
    if not bool(filtered.any()):  # the common RL case: no sort at all
        return z
    rows = filtered.nonzero().squeeze(1)
    z[rows] = _top_k_top_p(z[rows], top_k[rows], top_p[rows])
    return z


def _top_k_top_p(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf what top-k then top-p drop. The cut usually falls among the largest logits, so
    each row ranks its _TOP_CANDIDATES[0] largest first, then more, then all (that row's choice alone)."""
    vocab_size = z.shape[-1]
    k = torch.where((top_k > 0) & (top_k < vocab_size), top_k, torch.full_like(top_k, vocab_size))
    keep = torch.zeros(z.shape, dtype=torch.bool, device=z.device)
    rows = torch.arange(z.shape[0], device=z.device)  # rows not settled yet
    for c in [c for c in _TOP_CANDIDATES if c < vocab_size] + [vocab_size]:
        keep_c, settled = _keep_among_largest(z[rows], k[rows], top_p[rows], c)
        keep[rows[settled]] = keep_c[settled]
        rows = rows[~settled]
        if rows.numel() == 0:
            break
    return z.masked_fill(~keep, float("-inf"))


def _keep_among_largest(z: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor,
                        num_candidates: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep [R, V], settled [R]) from each row's num_candidates largest logits, ranked by value then
    id; settled: the row's cut provably falls among the candidates (every row when all are)."""
    vocab_size = z.shape[-1]
    c = num_candidates
    if c == vocab_size:
        values, ids = torch.sort(z, dim=-1, descending=True, stable=True)
    else:
        values, ids = torch.topk(z, c, dim=-1, sorted=False)
        # topk's order is unspecified: sort by id, then stably by value
        ids, by_id = ids.sort(dim=-1)
        values, by_value = values.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
        ids = ids.gather(1, by_value)
    rank = torch.arange(c, device=z.device)
    in_top_k = rank[None, :] < k[:, None]
    # float64 from here, so that rounding in the running sum does not move the cut
    values = values.to(torch.float64)
    # Normaliser of what top-k keeps: its k largest logits when they are all candidates, the
    # whole row when top-k is off. Rows with c < k < V cannot know it here (never settled).
    log_norm = torch.logsumexp(values.masked_fill(~in_top_k, float("-inf")), dim=-1)
    top_k_off = k >= vocab_size
    if bool((k > c).any()):
        log_norm = torch.where(top_k_off, torch.logsumexp(z.to(torch.float64), dim=-1), log_norm)
    probs = torch.exp(values - log_norm[:, None]).masked_fill(~in_top_k, 0.0)
    mass = torch.cumsum(probs, dim=-1)
    before = torch.cat([torch.zeros_like(mass[:, :1]), mass[:, :-1]], dim=-1)  # mass ranked before
    p = top_p.to(torch.float64)[:, None]
    use_p = p < 1  # top_p == 1 is "off", not "stop once the running sum rounds to 1"
    # the top token always stays: a top_p too small for float32 (it rounds to 0) keeps it alone
    keep_ranked = in_top_k & ((before < p) | ~use_p | (rank[None, :] == 0))
    keep = torch.zeros(z.shape, dtype=torch.bool, device=z.device).scatter_(1, ids, keep_ranked)
    if c == vocab_size:
        return keep, torch.ones_like(k, dtype=torch.bool)
    # Candidates above the smallest candidate logit are exactly the first tokens of the full
    # ranking; tokens equal to it may have been left out. The cut is settled when the token
    # right after those exact ones is dropped: by top-k, or because top-p's mass is reached.
    exact = (values > values[:, -1:]).sum(dim=-1)
    mass_exact = torch.cat([torch.zeros_like(mass[:, :1]), mass], dim=-1).gather(1, exact[:, None])
    settled = (k <= exact) | (((k <= c) | top_k_off) & use_p[:, 0] & (mass_exact >= p)[:, 0])
    return keep, settled


# --------------------------------------------------------------------------------- sampling

def sample(logits: torch.Tensor, seeds: torch.LongTensor, positions: torch.LongTensor,
           temperature: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor) -> tuple[torch.LongTensor, torch.Tensor]:
    """The coupled sample of each row: (tokens [M] int64, logprobs [M] float32): argmax(processed +
    G(seed, t, .)), or argmax(processed) for T == 0 (first index on ties), and its log_softmax, where
    processed = process_logits of the logits in float32. Row m depends on its own inputs alone."""
    logits = logits.to(torch.float32).contiguous()
    device = logits.device
    m, vocab_size = logits.shape
    seeds = torch.as_tensor(seeds, dtype=torch.int64)
    positions = torch.as_tensor(positions, dtype=torch.int64)
    temperature = temperature.to(device=device, dtype=torch.float32)
    top_k, top_p = top_k.to(device), top_p.to(device)
    tokens = torch.empty(m, dtype=torch.int64, device=device)
    logprobs = torch.empty(m, dtype=torch.float32, device=device)
    if m == 0:
        return tokens, logprobs
    greedy = temperature == 0
    any_greedy, any_random = bool(greedy.any()), not bool(greedy.all())
    chunks = list(_row_chunks(m, vocab_size, device))
    if any_random:
        noisy = _noisy_argmax(seeds, positions, vocab_size, device, max(r1 - r0 for r0, r1 in chunks))
    for r0, r1 in chunks:
        z = process_logits(logits[r0:r1], temperature[r0:r1], top_k[r0:r1], top_p[r0:r1])
        tok = noisy(r0, r1, z) if any_random else z.argmax(dim=-1)
        if any_random and any_greedy:
            tok = torch.where(greedy[r0:r1], z.argmax(dim=-1), tok)
        tokens[r0:r1] = tok
        logprobs[r0:r1] = torch.log_softmax(z, dim=-1).gather(1, tok[:, None]).squeeze(1)
    return tokens, logprobs


def _noisy_argmax(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int, device: torch.device,
                  chunk_rows: int) -> Callable[[int, int, torch.Tensor], torch.Tensor]:
    """(r0, r1, z) -> argmax(z + G(seed, t, .)) of rows r0..r1 (z: their processed logits): the CPU
    kernel's one pass per row, else the torch reference on scratch reused across chunks."""
    kernel = ops.noise_library(device)
    if kernel is not None:
        seeds, positions, keys = seeds.to(device), positions.to(device), vocab_keys32(vocab_size)
        return lambda r0, r1, z: noise_kernel.perturbed_argmax(kernel, seeds[r0:r1], positions[r0:r1], keys,
                                                               z.contiguous())
    a, b = _row_keys_to(device, seeds, positions)
    hv = _vocab_keys(vocab_size, device)
    scratch = _scratch(chunk_rows, vocab_size, device)
    noise = torch.empty(chunk_rows, vocab_size, dtype=torch.float32, device=device)

    def run(r0: int, r1: int, z: torch.Tensor) -> torch.Tensor:
        log_e = _log_exponential_(a[r0:r1], b[r0:r1], hv, noise[: r1 - r0], scratch)
        # z + G == z - log(E) exactly (G = -log E, and IEEE a + (-b) == a - b)
        return torch.sub(z, log_e, out=log_e).argmax(dim=-1)

    return run


def sampling_tensors(params_list: Sequence, device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """[M] (temperature float32, top_k int64, top_p float32) from objects with
    .temperature, .top_k, .top_p (rollout.config.SamplingParams), one per row."""
    m = len(params_list)
    if m and params_list.count(params_list[0]) == m:  # every row alike, the usual case: no per-row lists
        first = params_list[0]
        return (torch.full((m,), float(first.temperature), dtype=torch.float32, device=device),
                torch.full((m,), int(first.top_k), dtype=torch.int64, device=device),
                torch.full((m,), float(first.top_p), dtype=torch.float32, device=device))
    temperature = torch.tensor([float(p.temperature) for p in params_list], dtype=torch.float32)
    top_k = torch.tensor([int(p.top_k) for p in params_list], dtype=torch.int64)
    top_p = torch.tensor([float(p.top_p) for p in params_list], dtype=torch.float32)
    return temperature.to(device), top_k.to(device), top_p.to(device)


def token_logprobs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor, tokens: torch.LongTensor) -> torch.Tensor:
    """log_softmax(processed)[tokens] in float32, for given (not sampled) tokens: what the
    lenient mode compares against a history token's old logprob."""
    z = process_logits(logits, temperature, top_k, top_p)
    return torch.log_softmax(z, dim=-1).gather(1, tokens.to(z.device)[:, None]).squeeze(1)
