"""EAGLE-3's input and greedy-pick kernels (spec_decode/eagle3_kernels.py) against the torch code they replace, under
the Triton interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA), on the GPU with CUDA; and a
whole greedy drafting run with them against the torch path.
"""

from __future__ import annotations

import pytest
import torch

import research_lm.ops
from research_lm import SamplingParams
from research_lm.ops import rms_norm_ref
from research_lm.ops.rms_norm import rms_norm
from research_lm.worker.cuda_graphs import eager_capture
from spec_decode import eagle3_kernels
from spec_decode.eagle3_kernels import argmax_gather, eagle3_input
from tests.ops.cases import assert_matches, device
from tests.spec_decode.test_draft_graphs import K, _pair, _prompts, _run, _same_proposals, _spec


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eagle3_input_is_two_norms_of_a_lookup_side_by_side(dtype):
    gen = torch.Generator().manual_seed(0)
    vocab, hidden, t, eps = 50, 48, 5, 1e-6
    table = torch.randn(vocab, hidden, generator=gen).to(device(), dtype)
    features = (3 * torch.randn(t, hidden, generator=gen)).to(device(), dtype)
    w_in, w_hidden = (1 + 0.1 * torch.randn(2, hidden, generator=gen)).to(device(), dtype).unbind(0)
    ids = torch.tensor([3, 0, 49, 3, 17], device=device())
    got = eagle3_input(ids, table, features, w_in.contiguous(), w_hidden.contiguous(), eps)
    assert_matches(got, torch.cat([rms_norm_ref(table[ids], w_in, eps), rms_norm_ref(features, w_hidden, eps)], -1))
    # op for op the norm kernel's arithmetic: bit-identical to it
    w_in, w_hidden = w_in.contiguous(), w_hidden.contiguous()
    kernel = torch.cat([rms_norm(table[ids], w_in, eps), rms_norm(features, w_hidden, eps)], -1)
    assert torch.equal(got, kernel)


@pytest.mark.parametrize("vocab", [7, 768, 5000])  # 5000: more than one block of columns
def test_argmax_gather_takes_the_first_maximum_through_the_table(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(4, vocab, generator=gen).to(device(), torch.bfloat16)
    logits[1, vocab // 3] = logits[1, vocab - 1] = 9.0  # a tie: the first one wins
    logits[2] = 0.0  # all tied: index 0
    table = torch.randperm(10 * vocab, generator=gen)[:vocab].to(device())
    want = torch.index_select(table, 0, logits.argmax(dim=-1))
    assert torch.equal(argmax_gather(logits, table), want)
    out = torch.full((4,), -1, dtype=torch.int64, device=device())
    assert argmax_gather(logits, table, out=out) is out and torch.equal(out, want)
    assert out[1] == table[vocab // 3] and out[2] == table[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter variant; the GPU tests run the kernels anyway")
def test_greedy_drafting_with_the_kernels_drafts_what_the_torch_path_drafts(tiny_checkpoint, tmp_path, monkeypatch):
    """The graph chain (re-run on CPU) with the head's kernels on (`FUSED_DEVICE_TYPES` holding "cpu": every fused
    op runs in the interpreter) proposes what it proposes on the torch path, step for step."""
    checkpoint = tiny_checkpoint("llama")
    spec = _spec("eagle3", tmp_path, checkpoint)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (8, 6, 4)]
    _, torch_path = _pair(str(checkpoint), spec, "cpu", eager_capture)
    want, want_proposals, _ = _run(torch_path, _prompts(), params)
    calls = {"eagle3_input": 0, "argmax_gather": 0}
    for name in calls:
        real = getattr(eagle3_kernels, name)
        monkeypatch.setattr(eagle3_kernels, name,
                            lambda *a, _real=real, _name=name, **kw: calls.__setitem__(_name, calls[_name] + 1)
                            or _real(*a, **kw))
    monkeypatch.setattr(research_lm.ops, "FUSED_DEVICE_TYPES", ("cuda", "cpu"))
    _, fused = _pair(str(checkpoint), spec, "cpu", eager_capture)
    got, proposals, _ = _run(fused, _prompts(), params)
    assert got == want and _same_proposals(proposals, want_proposals)
    assert calls["eagle3_input"] >= K * len(proposals) // 2 and calls["argmax_gather"] > 0
