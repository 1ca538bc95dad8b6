"""Models with fused ops on give the torch path's logits, and the switch turns the kernels off.

Covers the wiring: the residual-fused norms of every decoder layer, Qwen3's per-head q/k norms on strided
views, DeepSeek's MLA rope (interleaved pairs, or strided views; k_pe of one head), Bamba's partial rotary,
and the SwiGLU MLPs. Without CUDA the kernels run under the Triton interpreter: the tests add "cpu" to the
device types the fused path serves (on a real run only CUDA tensors take it); with CUDA the model runs
there, on the real kernels.
"""

from __future__ import annotations

import pytest
import torch

import research_lm.ops
from research_lm import LLM
from research_lm.models import load_model
from research_lm.models.layers import RotaryEmbedding
from research_lm.ops import set_fused_ops
from tests.ops.cases import device
from tests.utils import forward_prefill


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    monkeypatch.setattr(research_lm.ops, "FUSED_DEVICE_TYPES", ("cuda", "cpu"))


def _calls(monkeypatch) -> dict[str, int]:
    """Count kernel launches per op, so a test knows the fused path ran."""
    import research_lm.ops.rms_norm as rms_mod
    import research_lm.ops.rotary as rot_mod
    import research_lm.ops.silu_and_mul as silu_mod

    calls = {"rms_norm": 0, "rotary_embedding": 0, "silu_and_mul": 0}
    for mod, name in ((rms_mod, "rms_norm"), (rot_mod, "rotary_embedding"), (silu_mod, "silu_and_mul")):
        real = getattr(mod, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(mod, name, counted)
    return calls


@pytest.mark.parametrize("name", ["llama", "qwen3", "deepseek-v2", "deepseek-v3-no-interleave", "bamba"])
def test_fused_forward_matches_the_torch_path(name, tiny_checkpoint, kernels_on_cpu, monkeypatch):
    model, hf_config = load_model(tiny_checkpoint(name), device=device(), dtype=torch.float32,
                                  attention_backend="torch_ref")
    seqs = [[3, 1, 4, 1, 5, 9, 2, 6], [5, 3]]
    calls = _calls(monkeypatch)
    fused = forward_prefill(model, seqs, block_size=4)
    layers = hf_config.num_hidden_layers
    assert calls["rms_norm"] >= 2 * layers + 1 and calls["rotary_embedding"] >= 1 and calls["silu_and_mul"] >= 1
    set_fused_ops(model, False)
    before = dict(calls)
    ref = forward_prefill(model, seqs, block_size=4)
    assert calls == before  # the switch reached every module
    for got, want in zip(fused, ref, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_rotary_embedding_leaves_cos_sin_to_the_kernel_only_on_the_fused_path(kernels_on_cpu):
    rope = RotaryEmbedding(16, {"rope_theta": 1e4}, 512)
    positions = torch.tensor([0, 3])
    assert rope(positions).cos is None
    rope.fused_ops = False
    torch.testing.assert_close(rope(positions).cos[1], torch.cos(3 * rope.inv_freq))


def test_cpu_tensors_take_the_torch_path_by_default():
    rope = RotaryEmbedding(16, {"rope_theta": 1e4}, 512)
    assert rope.fused_ops and rope(torch.tensor([1])).cos is not None


def test_engine_switch_reaches_the_target_and_the_drafter():
    """LLM(fused_ops=False) (runner.fused_ops=false) turns every fusable module off, the EAGLE-3 head's too."""

    def switches(llm: LLM) -> set[bool]:
        modules = [*llm.engine.model.modules(), *llm.engine.runner.proposer.head.modules()]
        return {m.fused_ops for m in modules if hasattr(m, "fused_ops")}

    spec = {"method": "eagle3", "model": "tiny-llama-eagle3", "num_speculative_tokens": 2}
    knobs = dict(device="cpu", max_model_len=64, speculative_config=spec)
    assert switches(LLM("tiny-llama", **knobs)) == {True}
    assert switches(LLM("tiny-llama", fused_ops=False, **knobs)) == {False}
