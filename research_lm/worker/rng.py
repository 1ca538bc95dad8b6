"""Counter-based randomness: the noise for one sampled token depends only on (seed, position, stream).

So a request samples the same tokens whatever else is in the batch, after a preemption, and
whether or not its tokens were speculated: the draw for output position p is always the same.

Construction (SplitMix64, Steele, Lea & Flood 2014, one stream per row):

    key(seed, position, stream) = fmix64(seed * A + position * B + stream * C)     (mod 2^64)
    bits[col]                   = fmix64(key + (col + 1) * GAMMA)                  (mod 2^64)

`fmix64` is SplitMix64's finaliser (Stafford's Mix13: xorshift-multiply-xorshift-multiply-xorshift),
a bijection of 64-bit words with full avalanche; `bits` is exactly the SplitMix64 sequence seeded
with `key`, a generator that passes BigCrush. Keys are themselves hashed, so two rows' sequences
overlap only if their keys differ by d * GAMMA with |d| < n (probability ~ 2n / 2^64 per pair).

A whole [rows, n] block costs about 20 elementwise device ops (and a few numpy ops hashing the
[rows] keys), whatever the number of rows; the per-row torch.Generators this replaces cost a
Python iteration and a kernel launch per row.
The words are int64: multiplication wraps modulo 2^64 (two's complement) and a logical right shift
is an arithmetic shift masked to the low 64 - s bits. Pure integer arithmetic has one answer, so
CPU and CUDA give bit-identical words, and bit-identical uniforms (their float conversion is
exact). Exponentials add one float64 `log` before rounding to float32; the devices' float64 logs
agree to within an ulp, so the float32 variates are the same except, rarely (~2^-29 per variate),
one float32 ulp apart.

Inputs: `seeds` and `positions` are Python lists (hashed on the host, then copied without a sync)
or int64 tensors (hashed where they live). Seeds are taken modulo 2^64.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_U64 = (1 << 64) - 1
_MASK = (1 << 63) - 1

# Independent streams per purpose, so the sampler's and the rejection sampler's draws never alias.
SAMPLE = 0
ACCEPT = 1
RECOVER = 2
DRAFT = 3
REPLAY = 4  # acceptance replay's per-slot uniforms (research_lm/worker/acceptance_replay.py)

_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment (odd, 2^64 / golden ratio)
_A, _B, _C = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # key mixing (odd)
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # fmix64 multipliers


def int64_bits(x: int) -> int:
    """The int64 with the same 64 bits as x (torch scalars must fit in int64)."""
    x &= _U64
    return x - (1 << 64) if x >> 63 else x


def _fmix64_py(x: int) -> int:
    """SplitMix64's finaliser on a Python int (the reference for `_fmix64_`)."""
    x &= _U64
    x ^= x >> 30
    x = (x * _M1) & _U64
    x ^= x >> 27
    x = (x * _M2) & _U64
    return x ^ (x >> 31)


def _fmix64_(z: torch.Tensor) -> torch.Tensor:  # int64, modified in place
    """`_fmix64_py` on int64 tensors: `>>` is arithmetic, so each shift is masked to be logical."""
    z ^= (z >> 30).bitwise_and_((1 << 34) - 1)
    z *= int64_bits(_M1)
    z ^= (z >> 27).bitwise_and_((1 << 37) - 1)
    z *= int64_bits(_M2)
    z ^= (z >> 31).bitwise_and_((1 << 33) - 1)
    return z


def mix_seed(seed: int, position: int, stream: int) -> int:
    """A 63-bit seed from (seed, position, stream): the row key below, top bit cleared."""
    return _fmix64_py(seed * _A + position * _B + stream * _C) & _MASK


def to_device(
    values: Sequence[int] | Sequence[float] | Sequence[bool] | torch.Tensor,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """Host values -> a `device` tensor without a host-device sync.

    `torch.tensor(..., device="cuda")` copies from pageable memory and waits for the stream, i.e.
    for the forward pass still queued on it. Staging in pinned memory makes the copy asynchronous
    (the caching host allocator keeps the staging block alive until the copy has run).
    """
    device = torch.device(device)
    pin = device.type == "cuda"
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu" or not pin or values.numel() == 0:
            return values.to(device=device, dtype=dtype)
        host = values.to(dtype).pin_memory()
    else:
        host = torch.tensor(values, dtype=dtype, pin_memory=pin and len(values) > 0)
    return host.to(device, non_blocking=pin)


def _int64(values: Sequence[int] | torch.Tensor) -> torch.Tensor:  # [R] int64, where it lives (lists: CPU)
    if isinstance(values, torch.Tensor):
        return values.to(torch.int64)
    try:
        return torch.tensor(values, dtype=torch.int64)
    except (OverflowError, RuntimeError, ValueError):  # a seed outside int64: same bits mod 2^64
        return torch.tensor([int64_bits(v) for v in values], dtype=torch.int64)


def row_keys(
    seeds: Sequence[int] | torch.Tensor,  # [R]
    positions: Sequence[int] | torch.Tensor,  # [R]
    stream: int | Sequence[int] | torch.Tensor,  # or [R], a stream per row
) -> torch.Tensor:  # [R] int64: fmix64(seed * A + position * B + stream * C)
    """Each row's SplitMix64 seed, hashed where the inputs live: with no tensor among them, on the host
    (`host_keys`, a few numpy ops instead of a dozen tiny torch ones); else on the tensors' device."""
    if not any(isinstance(x, torch.Tensor) for x in (seeds, positions, stream)):
        return torch.from_numpy(host_keys(seeds, positions, stream).view(np.int64))
    s, p = _int64(seeds), _int64(positions)
    assert s.shape == p.shape and s.dim() == 1, (s.shape, p.shape)
    if s.device != p.device:  # mixed: hash on the accelerator side
        dev = s.device if s.device.type != "cpu" else p.device
        s, p = to_device(s, torch.int64, dev), to_device(p, torch.int64, dev)
    key = s * int64_bits(_A)
    key.add_(p, alpha=int64_bits(_B))
    if isinstance(stream, int):
        key.add_(int64_bits(stream * _C))
    else:
        key.add_(to_device(stream, torch.int64, key.device), alpha=int64_bits(_C))
    return _fmix64_(key)


def _uint64(values: int | Sequence[int] | np.ndarray) -> np.ndarray:  # the same bits mod 2^64
    try:
        return np.asarray(values, dtype=np.int64).view(np.uint64)
    except OverflowError:  # a seed outside int64
        return (np.asarray(values, dtype=object) & _U64).astype(np.uint64)


def _fmix64_np(x: np.ndarray) -> np.ndarray:  # uint64: numpy wraps and shifts logically, as `_fmix64_py`
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(_M1)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(_M2)
    return x ^ (x >> np.uint64(31))


def host_keys(
    seeds: Sequence[int] | np.ndarray,  # [R]
    positions: Sequence[int] | np.ndarray,  # [R] (broadcasts against seeds)
    stream: int | Sequence[int] | np.ndarray,  # or [R]
) -> np.ndarray:  # uint64, the broadcast shape: `row_keys` on the host
    with np.errstate(over="ignore"):
        key = _uint64(seeds) * np.uint64(_A) + _uint64(positions) * np.uint64(_B) + _uint64(stream) * np.uint64(_C)
        return _fmix64_np(key)


def host_uniform(keys: np.ndarray) -> np.ndarray:  # uint64 keys -> float32: column 0 of `uniform_rows`
    """`uniform_rows(..., n=1)` of the rows whose `row_keys` are keys, on the host (bit-identical: the
    float32 steps are exact)."""
    with np.errstate(over="ignore"):
        z = _fmix64_np(keys + np.uint64(_GAMMA)).view(np.int64) >> 41  # arithmetic, as `uniform_rows`
    return (z.astype(np.float32) + np.float32(2**22 + 0.5)) * np.float32(2.0**-23)


def _words(keys: torch.Tensor, n: int) -> torch.Tensor:  # [R] int64 -> [R, n] int64
    """SplitMix64 outputs 1..n of each row's key (`row_keys`), where keys live."""
    cols = torch.arange(1, n + 1, dtype=torch.int64, device=keys.device)  # [n]
    z = torch.add(keys[:, None], cols[None, :], alpha=int64_bits(_GAMMA))  # key + (col + 1) * GAMMA
    return _fmix64_(z)


def _bits(
    seeds: Sequence[int] | torch.Tensor, positions: Sequence[int] | torch.Tensor, stream: int | torch.Tensor,
    n: int, device: torch.device | str,
) -> torch.Tensor:  # [R, n] int64: SplitMix64 outputs 1..n of each row's key
    return _words(to_device(row_keys(seeds, positions, stream), torch.int64, device), n)


def uniform_rows(
    seeds: Sequence[int] | torch.Tensor,  # [R]
    positions: Sequence[int] | torch.Tensor,  # [R]
    stream: int | torch.Tensor,  # or [R] int64
    n: int,
    device: torch.device | str,
) -> torch.Tensor:  # [R, n] float32 in (0, 1): never 0 or 1
    """The top 23 bits k of each word, as (k + 1/2) / 2^23 (exact in float32)."""
    z = _bits(seeds, positions, stream, n, device)
    z >>= 41  # arithmetic: a uniform integer in [-2^22, 2^22)
    return z.to(torch.float32).add_(2**22 + 0.5).mul_(2.0**-23)


def exponential_rows(
    seeds: Sequence[int] | torch.Tensor,  # [R]
    positions: Sequence[int] | torch.Tensor,  # [R]
    stream: int | torch.Tensor,  # or [R] int64
    n: int,
    device: torch.device | str,
) -> torch.Tensor:  # [R, n] float32, Exp(1), in [1e-16, 36.8]; argmax(p / q) samples from p
    """`exponential_from_keys` of the rows' `row_keys`."""
    return exponential_from_keys(to_device(row_keys(seeds, positions, stream), torch.int64, device), n)


def exponential_from_keys(keys: torch.Tensor, n: int) -> torch.Tensor:  # [R] int64 -> [R, n] float32
    """-log(u) with u = (k + 1/2) / 2^52 from the top 52 bits, in float64.

    float64 keeps small variates exact: in the exponential race a token of probability p wins with
    q ~ p, and a 24-bit u would resolve q only to 6e-8, under-sampling tokens with p below ~1e-7.
    """
    z = _words(keys, n)
    z >>= 12  # arithmetic: a uniform integer in [-2^51, 2^51)
    u = z.to(torch.float64).mul_(2.0**-52).add_(0.5 + 2.0**-53)  # exact: (2k + 1) / 2^53 < 1
    return u.log_().neg_().to(torch.float32)
