"""Every non-reference backend x every model family it serves, through the whole engine: greedy tokens equal
transformers.generate under chunked prefill (16 tokens a step) and preemption (20 blocks of 4), with prefix
caching where the model allows it. On CPU the Triton kernels run under the interpreter (tests/conftest.py);
tests/engine/test_generate_parity.py covers `torch_ref` the same way, test_gpu_engine.py the GPU."""

from __future__ import annotations

import pytest

from tests.models.stateful import engine_greedy_matches_transformers

# (tiny checkpoint, engine knobs): the backends under test for each layer kind the model has
CASES = [
    ("llama", {"attention_backend": "triton", "enable_prefix_caching": True}),
    ("qwen3", {"attention_backend": "triton", "enable_prefix_caching": True}),
    # a window of 8 frees blocks as sequences grow: fewer blocks still force preemption
    ("mistral", {"attention_backend": "triton", "num_gpu_blocks": 17}),
    ("qwen3-moe", {"attention_backend": "triton"}),
    ("deepseek-v2", {"mla_backend": "mla_triton"}),
    ("deepseek-v3-moe", {"mla_backend": "mla_triton"}),
    ("mamba2", {"mamba_backend": "mamba_triton"}),
    ("bamba", {"attention_backend": "triton", "mamba_backend": "mamba_triton"}),
]


@pytest.mark.parametrize("name, knobs", CASES, ids=[f"{n}-{'+'.join(k for k in kn if 'backend' in k)}"
                                                     for n, kn in CASES])
def test_backend_greedy_matches_transformers(name, knobs, tiny_checkpoint, hf_model):
    llm = engine_greedy_matches_transformers(tiny_checkpoint(name), hf_model(name), max_tokens=6, **knobs)
    names = {layer.backend.name for layer in llm.engine.runner.cache_layers}
    assert names >= {v for k, v in knobs.items() if k.endswith("backend")}, names
