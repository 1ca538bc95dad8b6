"""attention_backend="auto" (the default) picks, per layer kind, the fastest backend that serves the device, preferring
one that replays from CUDA graphs; an explicit name still wins; the engine records what was chosen."""

from __future__ import annotations

import pytest
import torch

from attention_zoo import AttentionSpec, select_backend
from attention_zoo.registry import auto_backend
from research_lm.api.config import EngineConfig

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # capabilities are data: no GPU needed to ask


def spec(kind: str = "attention", window: int | None = None) -> AttentionSpec:
    if kind == "mla":
        from attention_zoo.mla import MLASpec

        return MLASpec(num_heads=4, num_kv_heads=1, head_size=576, scale=0.1, kv_lora_rank=512, qk_nope_head_dim=128,
                       qk_rope_head_dim=64, v_head_dim=128)
    if kind == "mamba":
        from attention_zoo.mamba import MambaSpec

        return MambaSpec(num_heads=4, num_kv_heads=4, head_size=16, scale=1.0, state_size=16, conv_kernel=4)
    return AttentionSpec(num_heads=4, num_kv_heads=2, head_size=64, scale=0.125, sliding_window=window, kind=kind)


@pytest.mark.parametrize("kind, on_cpu, on_cuda", [
    ("attention", "torch_ref", "triton"), ("mla", "mla_torch_ref", "mla_triton"),
    ("mamba", "mamba_torch_ref", "mamba_triton")])
def test_auto_picks_the_torch_reference_on_cpu_and_triton_on_cuda(kind, on_cpu, on_cuda):
    assert auto_backend(spec(kind), CPU, torch.float32) == on_cpu
    assert auto_backend(spec(kind), CUDA, torch.bfloat16) == on_cuda
    assert select_backend("auto", spec(kind), CPU, torch.float32).name == on_cpu


def test_auto_prefers_a_backend_that_captures_cuda_graphs_and_serves_the_layer():
    chosen = select_backend("auto", spec(window=8), CUDA, torch.float16)
    assert chosen.capabilities.cuda_graphs and chosen.capabilities.sliding_window


def test_an_explicit_backend_wins_and_an_unknown_one_lists_auto():
    assert select_backend("torch_ref", spec(), CUDA, torch.bfloat16).name == "torch_ref"
    with pytest.raises(ValueError, match="'auto'"):
        select_backend("nope", spec(), CPU, torch.float32)


def test_batch_limits_are_sized_for_the_device_unless_given():
    c = EngineConfig()
    assert (c.max_num_seqs, c.max_num_batched_tokens, c.attention_backend) == (None, None, "auto")
    assert (c.for_device(CUDA).max_num_seqs, c.for_device(CUDA).max_num_batched_tokens) == (256, 16384)
    assert (c.for_device(CPU).max_num_seqs, c.for_device(CPU).max_num_batched_tokens) == (64, 2048)
    given = EngineConfig(max_num_seqs=4, max_num_batched_tokens=128).for_device(CUDA)
    assert (given.max_num_seqs, given.max_num_batched_tokens) == (4, 128)


@pytest.mark.parametrize("field, value, expected", [
    ("max_num_seqs", "abc", "an integer"), ("max_num_seqs", 2.5, "an integer"), ("cuda_graphs", "yes", "true or false"),
    ("gpu_memory_utilization", "0.5", "a number"), ("block_size", True, "an integer"), ("model", 3, "a string")])
def test_engine_config_names_a_field_of_the_wrong_type(field, value, expected):
    with pytest.raises(ValueError, match=f"^{field} must be .*{expected}"):
        EngineConfig(**{field: value})


@pytest.mark.parametrize("name, kinds", [("llama", {"attention": "torch_ref"}),
                                         ("deepseek-v2", {"mla": "mla_torch_ref"})])
def test_the_engine_records_what_auto_chose(tiny_checkpoint, name, kinds):
    from research_lm import LLM

    llm = LLM(str(tiny_checkpoint(name)), device="cpu", max_model_len=64)
    assert llm.engine.backends == kinds
    assert (llm.engine.config.max_num_seqs, llm.engine.config.max_num_batched_tokens) == (64, 2048)
