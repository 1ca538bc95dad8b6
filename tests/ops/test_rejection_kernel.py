"""The rejection sampler's Triton kernel gives its torch path's tokens exactly (the reference): acceptance with and
without draft probabilities, greedy and random requests side by side, zero drafts, all drafts accepted, and the
fall back to p when the residual max(0, p - q) is all zero.

Runs under the Triton interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA) with a tiny
vocabulary and the column block shrunk to 16, so every row scan spans several iterations; the GPU test runs a
real shape.
"""

from __future__ import annotations

import pytest
import torch

import research_lm.ops
import research_lm.ops.rejection_kernel as kernel_mod
from research_lm.worker.rejection_sampler import rejection_sample

V = 37


@pytest.fixture
def launches(monkeypatch) -> list[int]:
    """The kernel on CPU tensors too, with a 16-column block; counts its launches."""
    monkeypatch.setattr(research_lm.ops, "FUSED_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(kernel_mod, "_MAX_BLOCK", 16)
    calls: list[int] = []
    real = kernel_mod.fused_rejection_sample
    monkeypatch.setattr(kernel_mod, "fused_rejection_sample", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


def reference(*args) -> torch.Tensor:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(research_lm.ops, "FUSED_DEVICE_TYPES", ())
        return rejection_sample(*args)


def probs(rows: int, vocab: int, gen: torch.Generator, device: str = "cpu") -> torch.Tensor:
    """Peaked rows with about a third of the tokens at exactly 0 (as after top-k / top-p)."""
    logits = torch.randn(rows, vocab, generator=gen) / 0.5
    logits[torch.rand(rows, vocab, generator=gen) < 0.35] = float("-inf")
    logits[:, 0] = logits[:, 0].clamp(min=0.0)
    return logits.softmax(-1).to(device)


def batch(gen: torch.Generator, num_reqs: int, k_max: int, vocab: int, device: str = "cpu"):
    """Drafts of 0 .. k_max tokens per request, half of them the target's argmax (so runs get accepted)."""
    counts = torch.randint(0, k_max + 1, (num_reqs,), generator=gen).tolist()
    counts[0] = k_max
    target = probs(sum(counts) + num_reqs, vocab, gen, device)
    drafts, row = [], 0
    for c in counts:
        best = target[row : row + c].argmax(-1).cpu()
        noise = torch.randint(0, vocab, (c,), generator=gen)
        drafts.append(torch.where(torch.rand(c, generator=gen) < 0.5, best, noise).tolist())
        row += c + 1
    greedy = torch.rand(num_reqs, generator=gen) < 0.3
    seeds = torch.randint(0, 2**62, (num_reqs,), generator=gen).tolist()
    positions = torch.randint(0, 500, (num_reqs,), generator=gen).tolist()
    return drafts, target, greedy, seeds, positions


@pytest.mark.parametrize("with_q", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_kernel_gives_the_reference_tokens(with_q, seed, launches):
    gen = torch.Generator().manual_seed(seed)
    drafts, target, greedy, seeds, positions = batch(gen, 6, 4, V)
    q = probs(sum(map(len, drafts)), V, gen) if with_q else None
    got = rejection_sample(drafts, target, q, greedy, seeds, positions)
    assert launches and torch.equal(got, reference(drafts, target, q, greedy, seeds, positions))
    assert (got[:, 1:] >= 0).any() and (got == -1).any()  # some drafts accepted, some rejected


def test_all_accepted_zero_drafts_and_an_all_zero_residual(launches):
    """q = p accepts every draft (the bonus races over p); a request without drafts samples as the plain sampler;
    q >= p everywhere with p(x) = 0 rejects x with max(0, p - q) = 0, so the extra token races over p."""
    gen = torch.Generator().manual_seed(7)
    target = probs(3 + 3 + 1, V, gen)  # rows: request 0 (2 drafts + 1), request 1 (2 + 1), request 2
    x = int(target[3].argmin())  # p(x) = 0 on the third row, the first draft of request 1
    target[3, x] = 0.0
    drafts = [[int(t) for t in target[:2].argmax(-1)], [x, 1], []]
    q = torch.cat([target[:2], target[3:5]]).clone()
    q[2, x] = 0.5  # request 1's first draft: q > p there, q = p elsewhere
    args = (drafts, target, q, torch.zeros(3, dtype=torch.bool), [1, 2, 3], [0, 4, 9])
    got = rejection_sample(*args)
    want = reference(*args)
    assert launches and torch.equal(got, want)
    assert got[0, :2].tolist() == drafts[0] and got[0, 2] >= 0  # both accepted, then the bonus
    assert got[1, 0] != x and got[1, 1] == -1 and got[2, 0] >= 0 and got[2, 1] == -1


@pytest.mark.gpu
@pytest.mark.parametrize("with_q", [True, False])
def test_kernel_on_cuda_at_a_real_shape(with_q):
    """32 requests, k = 5, Llama-3's vocabulary: the torch path's tokens."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator().manual_seed(3)
    drafts, target, greedy, seeds, positions = batch(gen, 32, 5, 128256, "cuda")
    q = probs(sum(map(len, drafts)), 128256, gen, "cuda") if with_q else None
    got = rejection_sample(drafts, target, q, greedy, seeds, positions)
    assert torch.equal(got, reference(drafts, target, q, greedy, seeds, positions))
