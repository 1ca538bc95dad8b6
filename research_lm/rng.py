"""Counter-based randomness: the noise for one sampled token depends only on (seed, position, stream).

So a request samples the same tokens whatever else is in the batch, after a preemption, and
whether or not its tokens were speculated: the draw for output position p is always the same.
"""

from __future__ import annotations

import torch

_MASK = (1 << 63) - 1

# Independent streams per purpose, so the sampler's and the rejection sampler's draws never alias.
SAMPLE = 0
ACCEPT = 1
RECOVER = 2
DRAFT = 3


def mix_seed(seed: int, position: int, stream: int) -> int:
    """A 63-bit seed from (seed, position, stream) via splitmix64 finalisation."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + stream * 0x94D049BB133111EB) & (
        (1 << 64) - 1
    )
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & ((1 << 64) - 1)
    x ^= x >> 31
    return x & _MASK


def _generator(seed: int, position: int, stream: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(mix_seed(seed, position, stream))
    return g


def uniform_rows(
    seeds: list[int], positions: list[int], stream: int, n: int, device: torch.device
) -> torch.Tensor:  # [len(seeds), n] float32 in [0, 1)
    out = torch.empty(len(seeds), n, dtype=torch.float32, device=device)
    for i, (s, p) in enumerate(zip(seeds, positions, strict=True)):
        out[i].uniform_(generator=_generator(s, p, stream, device))
    return out


def exponential_rows(
    seeds: list[int], positions: list[int], stream: int, n: int, device: torch.device
) -> torch.Tensor:  # [len(seeds), n] float32, Exp(1); argmax(p / q) samples from p (exponential race)
    out = torch.empty(len(seeds), n, dtype=torch.float32, device=device)
    for i, (s, p) in enumerate(zip(seeds, positions, strict=True)):
        out[i].exponential_(generator=_generator(s, p, stream, device))
    return out
