"""Expert compute: the torch reference equals a per-pair loop, and the Triton grouped GEMM equals the reference.

On CPU the Triton kernel runs under the interpreter (TRITON_INTERPRET=1, set below before the kernel
module is imported) in fp32/fp16 at tiny shapes; `@pytest.mark.gpu` runs real shapes in bf16.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from research_lm.moe.experts import fused_experts, fused_experts_torch, resolve_moe_backend  # noqa: E402

ON_CPU = not torch.cuda.is_available()
DEVICE = "cpu" if ON_CPU else "cuda"


def _case(num_tokens, top_k, num_slots, hidden, inter, dtype=torch.float32, seed=0, device=DEVICE, skew=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_slots, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_slots, hidden, inter, generator=gen) / inter**0.5
    if skew:  # most pairs on slot 0; some slots get nothing
        ids = torch.stack([torch.cat([torch.tensor([0]), torch.randperm(num_slots - 1, generator=gen)[:top_k - 1] + 1])
                           for _ in range(num_tokens)])
    else:
        ids = torch.stack([torch.randperm(num_slots, generator=gen)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=gen)
    to = dict(device=device)
    return x.to(dtype=dtype, **to), w13.to(dtype=dtype, **to), w2.to(dtype=dtype, **to), weights.to(**to), ids.to(**to)


def _per_pair_loop(x, w13, w2, weights, ids):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = F.linear(x[t], w13[e]).chunk(2)
            out[t] += weights[t, j] * F.linear(F.silu(gate) * up, w2[e])
    return out


def test_torch_reference_equals_per_pair_loop():
    case = _case(13, 3, 6, 24, 20, device="cpu")
    torch.testing.assert_close(fused_experts_torch(*case), _per_pair_loop(*case), atol=1e-5, rtol=1e-5)


def test_backend_selection():
    assert resolve_moe_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_moe_backend("auto", torch.device("cuda")) == "triton"
    with pytest.raises(ValueError, match="supported"):
        resolve_moe_backend("cutlass", torch.device("cpu"))


def test_moe_align_pads_each_slot_to_tile():
    from research_lm.moe.triton_fused_moe import moe_align

    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 4]])
    sorted_ids, expert_ids, num_post = moe_align(ids, num_slots=6, block_m=4)
    counts = torch.bincount(ids.flatten(), minlength=6)  # [2, 1, 0, 4, 1, 0]
    assert int(num_post) == int(((counts + 3) // 4 * 4).sum()) == 16
    assert sorted_ids.numel() % 4 == 0 and sorted_ids.numel() >= 16
    flat = ids.flatten()
    used = sorted_ids[:16]
    real = used[used < flat.numel()]
    assert sorted(real.tolist()) == list(range(8))  # every pair exactly once
    for tile in range(4):
        pairs = used[tile * 4:(tile + 1) * 4]
        pairs = pairs[pairs < flat.numel()]
        assert (flat[pairs] == expert_ids[tile]).all()  # a tile holds pairs of its slot only
    assert expert_ids[:4].tolist() == [0, 1, 3, 4]


CASES = [
    # tokens, top_k, slots, hidden, inter, skew
    (7, 2, 5, 32, 48, False),  # ragged: inter and tokens not multiples of 16
    (1, 1, 4, 16, 16, False),  # one decode token
    (20, 2, 6, 32, 16, True),  # one hot slot spanning two tiles, empty slots
]


@pytest.mark.parametrize("num_tokens, top_k, num_slots, hidden, inter, skew", CASES)
def test_triton_matches_reference_fp32(num_tokens, top_k, num_slots, hidden, inter, skew):
    case = _case(num_tokens, top_k, num_slots, hidden, inter, skew=skew, seed=num_tokens)
    ref = fused_experts(*case, backend="torch")
    out = fused_experts(*case, backend="triton")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_triton_matches_reference_fp16():
    case = _case(6, 2, 4, 32, 32, dtype=torch.float16, seed=5)
    ref = fused_experts(*[t.float() if t.is_floating_point() else t for t in case], backend="torch")
    out = fused_experts(*case, backend="triton")
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_replicas_give_identical_rows():
    """Two slots holding the same expert produce the same output for the same token (backend-neutral)."""
    x, w13, w2, weights, _ = _case(4, 1, 3, 16, 16, seed=8)
    w13[2], w2[2] = w13[0], w2[0]
    a = fused_experts(x, w13, w2, weights, torch.zeros(4, 1, dtype=torch.int64, device=x.device), backend="triton")
    b = fused_experts(x, w13, w2, weights, torch.full((4, 1), 2, dtype=torch.int64, device=x.device),
                      backend="triton")
    assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(ON_CPU, reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [1, 64, 2048])
def test_triton_bf16_real_shapes(num_tokens):
    """Qwen3-30B-A3B-like layer: 128 experts, top-8, hidden 2048, moe_intermediate 768."""
    case = _case(num_tokens, 8, 128, 2048, 768, dtype=torch.bfloat16, seed=1)
    ref = fused_experts(*[t.float() if t.is_floating_point() else t for t in case], backend="torch")
    out = fused_experts(*case, backend="triton")
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


def test_model_with_triton_backend_matches_torch_backend(tiny_checkpoint):
    """`moe_backend` reaches every MoE layer of a loaded model (Qwen3-MoE, 2 redundant slots)."""
    from research_lm.models import load_model
    from research_lm.moe import FusedMoE
    from tests.utils import forward_prefill

    def logits(backend: str) -> list[torch.Tensor]:
        extra = {"moe_backend": backend, "eplb": {"num_redundant_experts": 2}}
        model, _ = load_model(tiny_checkpoint("qwen3-moe"), device=DEVICE, dtype=torch.float32,
                              attention_backend="torch_ref", extra=extra)
        assert {m.backend for m in model.modules() if isinstance(m, FusedMoE)} == {backend}
        return forward_prefill(model, [[5, 17, 3, 200, 9], [1, 2]], block_size=4)

    for ours, ref in zip(logits("triton"), logits("torch")):
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
