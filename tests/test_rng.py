"""Counter-based RNG: a row's draw depends only on (seed, position, stream); the draws look i.i.d.

Every test here is deterministic (fixed seeds), so the statistical thresholds never flake: they
either hold for this generator or they do not.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from research_lm.worker import rng

CPU = torch.device("cpu")
U64 = (1 << 64) - 1


def splitmix64(state: int, n: int) -> list[int]:
    """The reference generator (Vigna's splitmix64.c), on Python ints."""
    out = []
    for _ in range(n):
        state = (state + 0x9E3779B97F4A7C15) & U64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & U64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & U64
        out.append(z ^ (z >> 31))
    return out


def reference_words(seed: int, position: int, stream: int, n: int) -> list[int]:  # as int64
    key = splitmix64((seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + stream * 0x94D049BB133111EB
                      - 0x9E3779B97F4A7C15) & U64, 1)[0]  # fmix64 of the linear combination
    return [w - (1 << 64) if w >> 63 else w for w in splitmix64(key, n)]


def ks_pvalue(samples: torch.Tensor, cdf) -> float:
    """One-sample Kolmogorov-Smirnov test, asymptotic p-value (Stephens' small-n correction)."""
    x = samples.double().sort().values
    n = x.numel()
    f = cdf(x)
    i = torch.arange(1, n + 1, dtype=torch.float64)
    d = float(torch.maximum(i / n - f, f - (i - 1) / n).max())
    lam = (math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n)) * d
    return max(0.0, min(1.0, 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))))


def chi2_pvalue(counts: torch.Tensor) -> float:  # counts of equiprobable bins
    expected = counts.sum().double() / counts.numel()
    stat = ((counts.double() - expected) ** 2 / expected).sum()
    df = counts.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def grid(num_seeds: int, num_positions: int, seed0: int = 0) -> tuple[list[int], list[int]]:
    """Consecutive seeds x consecutive positions: the most structured inputs a user can give."""
    seeds = [seed0 + s for s in range(num_seeds) for _ in range(num_positions)]
    return seeds, list(range(num_positions)) * num_seeds


# ---------------------------------------------------------------------------------------------
# The construction
# ---------------------------------------------------------------------------------------------


def test_words_are_splitmix64_of_the_row_key():
    # Canonical splitmix64 output for state 1234567, so the finaliser constants are the real ones.
    assert splitmix64(1234567, 1)[0] == 6457827717110365317
    seeds = [0, 1, -5, 2**63 + 7, 2**70 + 3, 12345678901234567, -(2**63)]
    positions = [0, 3, 7, 1, 2, 99_999, 5]
    for stream in (rng.SAMPLE, rng.ACCEPT, rng.RECOVER, rng.DRAFT):
        words = rng._bits(seeds, positions, stream, 6, CPU)
        assert words.dtype == torch.int64 and words.shape == (7, 6)
        for row, s, p in zip(words.tolist(), seeds, positions):
            assert row == reference_words(s, p, stream, 6)
        keys = rng.row_keys(seeds, positions, stream).bitwise_and((1 << 63) - 1)
        assert keys.tolist() == [rng.mix_seed(s, p, stream) for s, p in zip(seeds, positions)]


def test_uniform_and_exponential_are_exact_transforms_of_the_words():
    words = rng._bits([3, 4], [10, 11], rng.ACCEPT, 50, CPU)
    u = rng.uniform_rows([3, 4], [10, 11], rng.ACCEPT, 50, CPU)
    k = (words >> 41) + 2**22  # top 23 bits
    assert u.dtype == torch.float32 and torch.equal(u.double(), (k.double() + 0.5) / 2**23)
    e = rng.exponential_rows([3, 4], [10, 11], rng.ACCEPT, 50, CPU)
    k52 = (words >> 12) + 2**51  # top 52 bits
    assert e.dtype == torch.float32 and torch.equal(e, (-torch.log((k52.double() + 0.5) / 2**52)).float())


def test_inputs_as_lists_tensors_and_per_row_streams_agree():
    seeds, positions = [11, 2**64 - 1, 7], [0, 5, 123]
    by_list = rng.exponential_rows(seeds, positions, rng.RECOVER, 9, CPU)
    seeds_t = torch.tensor([11, -1, 7])  # 2^64 - 1 and -1 are the same 64 bits
    by_tensor = rng.exponential_rows(seeds_t, torch.tensor(positions), rng.RECOVER, 9, CPU)
    mixed = rng.exponential_rows(seeds, torch.tensor(positions), rng.RECOVER, 9, "cpu")
    assert torch.equal(by_list, by_tensor) and torch.equal(by_list, mixed)
    streams = torch.tensor([rng.SAMPLE, rng.RECOVER, rng.ACCEPT])
    per_row = rng.uniform_rows(seeds, positions, streams, 4, CPU)
    for i, s in enumerate(streams.tolist()):
        assert torch.equal(per_row[i], rng.uniform_rows(seeds[i : i + 1], positions[i : i + 1], s, 4, CPU)[0])


def test_host_keys_and_uniforms_match_the_torch_path_and_broadcast():
    """The rejection sampler hashes a [requests, slots] grid on the host (numpy): same keys and uniforms as torch."""
    seeds, positions = [11, 2**64 - 1, -3, 2**70 + 3], np.array([0, 5, 123, 7])
    slots = np.arange(3)
    keys = rng.host_keys(np.array(seeds, dtype=object)[:, None], positions[:, None] + slots, rng.ACCEPT)  # [4, 3]
    u = rng.host_uniform(keys)
    seeds_t = torch.tensor([rng.int64_bits(s) for s in seeds])
    for j in slots:
        col = (positions + j).tolist()
        want = rng.row_keys(seeds_t, torch.tensor(col), rng.ACCEPT)  # hashed by torch
        assert torch.equal(torch.from_numpy(keys[:, j].view(np.int64)), want)
        assert u.dtype == np.float32 and torch.equal(torch.from_numpy(u[:, j]),
                                                     rng.uniform_rows(seeds, col, rng.ACCEPT, 1, CPU)[:, 0])


# ---------------------------------------------------------------------------------------------
# Batch invariance
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [rng.uniform_rows, rng.exponential_rows])
def test_a_rows_draw_depends_only_on_seed_position_stream(fn):
    alone = fn([42], [17], rng.SAMPLE, 64, CPU)[0]
    gen = torch.Generator().manual_seed(0)
    for size, where in [(2, 0), (5, 4), (33, 16), (200, 123)]:
        seeds = torch.randint(0, 2**62, (size,), generator=gen)
        positions = torch.randint(0, 10_000, (size,), generator=gen)
        seeds[where], positions[where] = 42, 17
        block = fn(seeds.tolist(), positions.tolist(), rng.SAMPLE, 64, CPU)
        assert torch.equal(block[where], alone)
        # Every other row is its own single-row draw too (spot check).
        j = (where + 1) % size
        assert torch.equal(block[j], fn([int(seeds[j])], [int(positions[j])], rng.SAMPLE, 64, CPU)[0])
    # A prefix of the columns does not depend on how many columns were drawn.
    assert torch.equal(fn([42], [17], rng.SAMPLE, 5, CPU)[0], alone[:5])


# ---------------------------------------------------------------------------------------------
# Statistics (~1e5 draws from structured inputs: consecutive seeds and positions)
# ---------------------------------------------------------------------------------------------


def test_uniform_statistics():
    seeds, positions = grid(40, 25)
    u = rng.uniform_rows(seeds, positions, rng.ACCEPT, 100, CPU).flatten()  # 1e5 draws
    n = u.numel()
    assert n == 100_000 and 0.0 < float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.double().mean()) - 0.5) < 4 * math.sqrt(1 / 12 / n)
    assert abs(float(u.double().var()) - 1 / 12) < 4 * math.sqrt(1 / 180 / n)  # sd: sqrt((mu4 - var^2) / n)
    assert ks_pvalue(u, lambda x: x) > 0.01
    assert chi2_pvalue(torch.bincount((u * 256).long(), minlength=256)) > 0.01
    # The first column alone (one draw per row, as the acceptance test uses it) is uniform too.
    seeds, positions = grid(500, 200)
    first = rng.uniform_rows(seeds, positions, rng.ACCEPT, 1, CPU)[:, 0]
    assert ks_pvalue(first, lambda x: x) > 0.01


def test_exponential_statistics():
    seeds, positions = grid(25, 40, seed0=1000)
    e = rng.exponential_rows(seeds, positions, rng.SAMPLE, 100, CPU).flatten()  # 1e5 draws
    n = e.numel()
    assert torch.isfinite(e).all() and float(e.min()) > 0.0
    assert abs(float(e.double().mean()) - 1.0) < 4 / math.sqrt(n)
    assert abs(float(e.double().var()) - 1.0) < 4 * math.sqrt(8 / n)  # sd: sqrt((mu4 - var^2) / n), mu4 = 9
    assert ks_pvalue(e, lambda x: 1 - torch.exp(-x)) > 0.01
    assert chi2_pvalue(torch.bincount((torch.exp(-e.double()) * 128).long(), minlength=128)) > 0.01


@pytest.mark.parametrize(
    "other",
    [
        dict(stream=rng.RECOVER),  # another stream, same row
        dict(position=1),  # the next position
        dict(seed=1),  # the next seed
    ],
    ids=["stream", "position", "seed"],
)
def test_neighbouring_rows_look_independent(other):
    """u from (seed, position, stream) vs its neighbour: no correlation, uniform joint histogram."""
    seeds, positions = grid(50, 20)
    a = rng.uniform_rows(seeds, positions, rng.SAMPLE, 100, CPU).double().flatten()
    b_seeds = [s + other.get("seed", 0) for s in seeds]
    b_positions = [p + other.get("position", 0) for p in positions]
    b = rng.uniform_rows(b_seeds, b_positions, other.get("stream", rng.SAMPLE), 100, CPU).double().flatten()
    n = a.numel()
    corr = float(torch.corrcoef(torch.stack([a, b]))[0, 1])
    assert abs(corr) < 4 / math.sqrt(n)
    joint = (a * 16).long() * 16 + (b * 16).long()  # 16 x 16 equiprobable cells under independence
    assert chi2_pvalue(torch.bincount(joint, minlength=256)) > 0.01
    # Neighbouring columns of one row are independent as well.
    lag = torch.corrcoef(torch.stack([a.view(-1, 100)[:, :-1].flatten(), a.view(-1, 100)[:, 1:].flatten()]))
    assert abs(float(lag[0, 1])) < 4 / math.sqrt(n)


def test_no_two_rows_share_noise():
    seeds, positions = grid(100, 100)
    words = rng._bits(seeds, positions, rng.SAMPLE, 4, CPU)
    assert torch.unique(words.flatten()).numel() == words.numel()


# ---------------------------------------------------------------------------------------------
# Devices
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cpu_and_cuda_give_the_same_numbers():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    seeds, positions = grid(64, 4, seed0=2**62)
    cuda = torch.device("cuda")
    assert torch.equal(rng._bits(seeds, positions, rng.DRAFT, 1000, cuda).cpu(),
                       rng._bits(seeds, positions, rng.DRAFT, 1000, CPU))
    assert torch.equal(rng.uniform_rows(seeds, positions, rng.ACCEPT, 1000, cuda).cpu(),
                       rng.uniform_rows(seeds, positions, rng.ACCEPT, 1000, CPU))
    on_cuda = rng.exponential_rows(torch.tensor(seeds, device=cuda), torch.tensor(positions, device=cuda),
                                   rng.SAMPLE, 1000, cuda).cpu()
    on_cpu = rng.exponential_rows(seeds, positions, rng.SAMPLE, 1000, CPU)
    # float64 logs of the two libms may differ by an ulp: float32 results equal or one ulp apart.
    assert (on_cuda != on_cpu).float().mean() < 1e-4
    torch.testing.assert_close(on_cuda, on_cpu, rtol=2**-23, atol=0)
