"""The fused exponential race gives `random_sample`'s torch-path tokens exactly: its noise is `rng`'s bit for bit,
its argmax follows torch's rule (first index on ties, NaN first) within a loop, across lanes and across splits of
a row, and the wired `random_sample` (hence the drafters) takes it where the device type is enabled. The rejection
sampler's own kernel, which reuses its noise, is tested in tests/ops/test_rejection_kernel.py.

Runs under the Triton interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA); shapes are
tiny and `block` / `chunk` are shrunk so that a few columns already span several iterations and splits.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import research_lm.ops
import research_lm.ops.exponential_race as race_mod
from research_lm.ops.exponential_race import exponential_noise, exponential_race, uniform53
from research_lm.worker import rng
from research_lm.worker.sampler import random_sample
from tests.ops.cases import device


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    monkeypatch.setattr(research_lm.ops, "FUSED_DEVICE_TYPES", ("cuda", "cpu"))


@pytest.fixture
def launches(monkeypatch) -> list[int]:
    """Count calls of the kernel's launcher, so a test knows which path ran."""
    calls: list[int] = []
    real = race_mod.exponential_race

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(race_mod, "exponential_race", counted)
    return calls


def torch_path(probs, seeds, positions, stream=rng.SAMPLE) -> torch.Tensor:
    """`random_sample` with the kernels off: the reference."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(research_lm.ops, "FUSED_DEVICE_TYPES", ())
        return random_sample(probs, seeds, positions, stream)


def sparse_probs(rows: int, vocab: int, gen: torch.Generator, keep: float = 0.5) -> torch.Tensor:
    """Peaked distributions (a temperature below 1) with about 1 - keep of the tokens at exactly 0 (top-k/p)."""
    logits = torch.randn(rows, vocab, generator=gen) / 0.6
    logits[torch.rand(rows, vocab, generator=gen) > keep] = float("-inf")
    logits[:, 0] = logits[:, 0].clamp(min=0.0)  # every row keeps a token
    return logits.softmax(-1).to(device())


def keys_of(seeds, positions, stream=rng.SAMPLE) -> torch.Tensor:
    return rng.to_device(rng.row_keys(seeds, positions, stream), torch.int64, device())


@triton.jit
def _noise_kernel(keys_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    key = tl.load(keys_ptr + row).to(tl.uint64, bitcast=True)
    tl.store(out_ptr + row * V + cols, exponential_noise(key, cols), mask=cols < V)


@triton.jit
def _uniform_kernel(keys_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    key = tl.load(keys_ptr + row).to(tl.uint64, bitcast=True)
    tl.store(out_ptr + row * V + cols, uniform53(key, cols), mask=cols < V)


def test_uniforms_are_torchs_bit_for_bit():
    """The float64 u before the log: torch's arithmetic shift, scale and offset, exactly."""
    seeds, positions, vocab = [0, 2**63 + 5, 99], [3, 1, 2**33], 100
    out = torch.empty(len(seeds), vocab, dtype=torch.float64, device=device())
    _uniform_kernel[(len(seeds),)](keys_of(seeds, positions), out, vocab, BLOCK=128)
    z = rng._bits(seeds, positions, rng.SAMPLE, vocab, device())
    z >>= 12
    want = z.to(torch.float64).mul_(2.0**-52).add_(0.5 + 2.0**-53)  # as rng.exponential_rows
    assert torch.equal(out, want) and want.min() > 0 and want.max() < 1


def test_noise_is_rngs_bit_for_bit():
    """Exact float32 equality with `rng.exponential_rows` (the float64 logs agree on these draws), including keys
    with the top bit set and seeds beyond int64."""
    seeds, positions = [0, 1, 2**63 + 5, 2**64 - 1, 123456789], [0, 7, 3, 2**40, 1]
    vocab = 200
    keys = keys_of(seeds, positions, rng.RECOVER)
    assert (keys < 0).any() and (keys > 0).any()
    out = torch.empty(len(seeds), vocab, device=device())
    _noise_kernel[(len(seeds), 2)](keys, out, vocab, BLOCK=128)
    want = rng.exponential_rows(seeds, positions, rng.RECOVER, vocab, device())
    assert torch.equal(out, want)


@pytest.mark.parametrize("rows", [1, 3, 7])
@pytest.mark.parametrize("vocab", [5, 64, 1000])
def test_race_matches_random_sample(rows, vocab):
    gen = torch.Generator().manual_seed(rows * 10_000 + vocab)
    probs = sparse_probs(rows, vocab, gen)
    seeds, positions = [1000 + 17 * i for i in range(rows)], [3 * i + 1 for i in range(rows)]
    # vocab 1000: one program of 1000 columns, and 8 splits of 128 in iterations of 64
    for block, chunk in [(None, None)] + ([(64, 128)] if vocab == 1000 else []):
        got = exponential_race(probs, keys_of(seeds, positions), block=block, chunk=chunk)
        assert got.dtype == torch.int64 and got.shape == (rows,)
        assert torch.equal(got, torch_path(probs, seeds, positions))


def test_race_matches_random_sample_over_many_rows():
    """Small vocabularies make every draw count: a wrong bit anywhere in the noise shows up in some token."""
    gen = torch.Generator().manual_seed(11)
    rows, vocab = 128, 12
    probs = sparse_probs(rows, vocab, gen, keep=0.8)
    seeds, positions = list(range(rows)), [i % 5 for i in range(rows)]
    for block, chunk in [(None, None), (4, 4)]:
        got = exponential_race(probs, keys_of(seeds, positions), block=block, chunk=chunk)
        assert torch.equal(got, torch_path(probs, seeds, positions))


def test_ties_zeros_and_nans_follow_torch_argmax():
    """Rows whose ratio ties exactly (p = q gives p / q = 1), across lanes, iterations and splits; an all-zero row;
    -0.0; NaN. Iterations of 16 columns, programs of 32."""
    vocab, seeds, positions = 100, [5] * 6, list(range(6))
    q = rng.exponential_rows(seeds, positions, rng.SAMPLE, vocab, device())
    probs = torch.zeros(6, vocab, device=device())
    # 37 (lane 5) beats 99 (lane 3) of a later split; 70 beats 81, the later iteration's lane 1; 67 and 83 share
    # lane 3 of one program
    for row, cols in enumerate([[99, 37, 70], [81, 70], [83, 67]]):
        probs[row, cols] = q[row, cols]
    probs[3, 1::2] = -0.0  # a tie of zeros (and -0.0): the first index
    probs[4, [40, 90]] = float("nan")  # the first NaN, over larger values
    probs[4, 10] = 1.0
    probs[5, 60] = float("nan")
    want = torch_path(probs, seeds, positions)
    assert want.tolist() == [37, 70, 67, 0, 40, 60]
    for block, chunk in [(None, None), (16, 32), (16, 16)]:
        assert torch.equal(exponential_race(probs, keys_of(seeds, positions), block=block, chunk=chunk), want)


def test_row_strides_and_empty_batches():
    gen = torch.Generator().manual_seed(2)
    wide = sparse_probs(4, 80, gen)
    probs = wide[:, :50]  # rows 80 apart
    want = torch_path(probs.contiguous(), [1, 2, 3, 4], [0, 0, 0, 0])
    assert torch.equal(exponential_race(probs, keys_of([1, 2, 3, 4], [0, 0, 0, 0])), want)
    empty = torch.empty(0, 50, device=device())
    assert exponential_race(empty, keys_of([], [])).shape == (0,)
    with pytest.raises(AssertionError):
        exponential_race(probs.double(), keys_of([1, 2, 3, 4], [0, 0, 0, 0]))


def test_random_sample_takes_the_kernel_where_enabled(kernels_on_cpu, launches):
    """Per-row streams as a device tensor and positions on the device, as the rejection sampler passes them."""
    gen = torch.Generator().manual_seed(5)
    probs = sparse_probs(6, 40, gen)
    seeds = [7, 8, 2**64 - 3, 10, 11, 12]
    positions = torch.tensor([4, 5, 6, 7, 8, 9], device=device())
    streams = torch.tensor([rng.SAMPLE, rng.RECOVER] * 3, device=device())
    got = random_sample(probs, seeds, positions, streams)
    assert len(launches) == 1
    assert torch.equal(got, torch_path(probs, seeds, positions, streams))
    assert torch.equal(random_sample(probs, seeds, positions.tolist(), rng.DRAFT),
                       torch_path(probs, seeds, positions.tolist(), rng.DRAFT))
    assert len(launches) == 2


def test_cpu_tensors_take_the_torch_path_by_default(launches):
    probs = torch.full((2, 8), 0.125)
    random_sample(probs, [1, 2], [0, 0])
    assert launches == []


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 256])
def test_race_on_cuda_at_a_real_shape(rows):
    """Llama-3's vocabulary at temperature 0.6, half the rows top-k'd to 50: the tokens of the torch path."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    vocab, cuda = 128256, torch.device("cuda")
    gen = torch.Generator(device=cuda).manual_seed(rows)
    logits = torch.randn(rows, vocab, device=cuda, generator=gen) * 3 / 0.6
    kth = logits.topk(50, dim=-1).values[:, -1:]
    logits[::2] = logits[::2].masked_fill(logits[::2] < kth[::2], float("-inf"))
    probs = logits.softmax(-1)
    seeds, positions = list(range(10**6, 10**6 + rows)), [(7 * i) % 300 for i in range(rows)]
    got = random_sample(probs, seeds, positions)  # CUDA: the kernel
    assert torch.equal(got, torch_path(probs, seeds, positions))
    # The noise itself (libdevice's float64 log against torch's): expected bit-identical.
    seeds, positions = [10**6, 5, 2**63 + 1, 77], [0, 7, 14, 2**20]  # 4 rows, whatever `rows` is
    keys = rng.to_device(rng.row_keys(seeds, positions, rng.SAMPLE), torch.int64, cuda)
    out = torch.empty(4, vocab, device=cuda)
    _noise_kernel[(4, triton.cdiv(vocab, 1024))](keys, out, vocab, BLOCK=1024)
    want = rng.exponential_rows(seeds, positions, rng.SAMPLE, vocab, cuda)
    assert (out != want).sum().item() == 0, f"{(out != want).sum().item()} variates differ (by an ulp?)"
