"""`compile=True` (runner.compile) gives the eager engine's greedy tokens, also when the decode graphs capture
the compiled forward; dynamo compiles around the attention layers (they stay eager).

On CPU the graph capture is stood in for by a re-run (`eager_capture`, as in tests/test_cuda_graphs.py) and the
Triton attention runs under the interpreter. The CPU test compiles with "aot_eager" (dynamo + AOTAutograd, no
code generation): on the 2-core CI machines inductor's C++ build takes ~85 s for tiny-llama (its tokens
matched too). The GPU test runs inductor with real CUDA graphs (`-m gpu`).
"""

from __future__ import annotations

import pytest
import torch

import research_lm.worker.compilation as compilation
from research_lm import LLM, SamplingParams
from research_lm.worker.cuda_graphs import DecodeGraphs, eager_capture

KNOBS = dict(dtype="float32", attention_backend="triton", block_size=4, max_num_batched_tokens=32, max_num_seqs=4,
             num_gpu_blocks=24, max_model_len=48)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(256, (n,), generator=g).tolist() for n in (5, 9, 3)]


def _generate(llm: LLM) -> list[list[int]]:
    # different lengths: decode batches shrink 3 -> 2 -> 1, so padded sizes (3 -> 4) and batch 1 occur
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (6, 4, 2)]
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]


def test_compiled_forward_gives_the_eager_tokens_on_cpu(tiny_checkpoint, monkeypatch):
    graphs: list[torch.fx.GraphModule] = []

    def recording(gm: torch.fx.GraphModule, example_inputs):  # keeps dynamo's graphs, then AOTAutograd
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    monkeypatch.setattr(compilation, "COMPILE_BACKEND", recording)
    torch.compiler.reset()
    path = str(tiny_checkpoint("llama"))
    want = _generate(LLM(path, device="cpu", **KNOBS))

    llm = LLM(path, device="cpu", compile=True, **KNOBS)
    runner = llm.engine.runner
    assert runner.forward is not runner.model
    runner.cuda_graphs = DecodeGraphs(runner.forward, runner.buffers, runner.backends, sizes=[1, 2, 4],
                                      block_size=4, max_seq_len=48, capture=eager_capture)
    assert _generate(llm) == want
    assert graphs, "nothing was compiled"
    traced = {str(node.target) for gm in graphs for node in gm.graph.nodes}
    assert not any("triton_kernel_wrapper" in t for t in traced)  # attention's Triton launches stay eager


@pytest.mark.gpu
def test_compiled_forward_under_cuda_graphs_gives_the_eager_tokens_on_cuda(tiny_checkpoint):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.compiler.reset()
    path = str(tiny_checkpoint("llama"))
    knobs = dict(KNOBS, device="cuda", cuda_graph_sizes=[1, 2, 4])
    want = _generate(LLM(path, cuda_graphs=False, **knobs))
    llm = LLM(path, compile=True, cuda_graphs=True, **knobs)
    assert llm.engine.runner.cuda_graphs is not None
    assert _generate(llm) == want
