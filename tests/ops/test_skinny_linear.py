"""The skinny linear kernels (a few rows, the norm before it and SwiGLU / the residual after it fused in; a program per
row, or all rows in one) equal `skinny_linear_ref`, the per-op path, for every dtype and fusion, ragged N and K, and
K longer than one tile; a row's output does not depend on the others'; and a decoder that takes them (decode steps
of up to SKINNY_MAX_ROWS tokens) gives the per-op path's logits and tokens.

Runs under the Triton interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA).
"""

from __future__ import annotations

import pytest
import torch

import research_lm.ops
from research_lm import LLM, SamplingParams
from research_lm.models import load_model
from research_lm.ops import SKINNY_MAX_ROWS, set_fused_ops, set_skinny_rows, skinny_linear_ref
from research_lm.ops.skinny_linear import SkinnyTile, skinny_linear, skinny_tiles
from tests.ops.cases import DTYPES, assert_matches, device, poison_outputs, randn
from tests.utils import PagedBatch


@pytest.mark.parametrize("rows_per_program", [1, SKINNY_MAX_ROWS], ids=["row", "rows"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fusion", ["plain", "norm", "norm_silu_mul", "residual", "bias_norm_silu_mul"])
@pytest.mark.parametrize("m, n, k", [(1, 48, 64), (3, 37, 96), (4, 20, 2600)])
def test_skinny_linear_matches_the_per_op_path(dtype, fusion, m, n, k, rows_per_program):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    silu_mul = "silu_mul" in fusion
    rows = 2 * n if silu_mul else n
    x = randn((m, k), dtype, gen)
    weight = randn((rows, k), dtype, gen) / k**0.5
    kwargs = {
        "bias": randn((rows,), dtype, gen) if "bias" in fusion else None,
        "norm_weight": (1 + randn((k,), dtype, gen) / 4).to(dtype) if "norm" in fusion else None,
        "eps": 1e-5,
        "silu_mul": silu_mul,
        "residual": randn((m, n), dtype, gen) if fusion == "residual" else None,
    }
    inputs = [t.clone() for t in (x, weight) if t is not None]
    with poison_outputs():
        got = skinny_linear(x, weight, rows_per_program=rows_per_program, **kwargs)
    assert_matches(got, skinny_linear_ref(x, weight, **kwargs))
    for before, after in zip(inputs, (x, weight), strict=True):
        torch.testing.assert_close(after, before, atol=0, rtol=0)


def test_tiles_cover_k_in_loads_of_at_most_2048_and_never_depend_on_m():
    assert skinny_tiles(3072, 2048) == (4, 2048, 4)
    assert skinny_tiles(2048, 8192) == (4, 2048, 4)
    assert skinny_tiles(5, 96) == (8, 128, 4)  # ragged: N (5) rounds up
    assert skinny_tiles(3072, 2048, "a GPU never tuned") == (4, 2048, 4)
    # all rows in one program: 8K products over the 4 rows, K blocks of at most 256
    assert skinny_tiles(3072, 2048, None, SKINNY_MAX_ROWS) == skinny_tiles(2048, 8192, None, SKINNY_MAX_ROWS) == (
        8, 256, 4)


@pytest.mark.parametrize("rows_per_program", [1, SKINNY_MAX_ROWS], ids=["row", "rows"])
@pytest.mark.parametrize("tile", [SkinnyTile(1, 32, 2), SkinnyTile(16, 64, 4)])
def test_any_tile_gives_the_same_numbers(tile, rows_per_program):
    gen = torch.Generator().manual_seed(7)
    x, weight = randn((2, 200), torch.bfloat16, gen), randn((2 * 24, 200), torch.bfloat16, gen) / 14
    kwargs = {"norm_weight": randn((200,), torch.bfloat16, gen), "eps": 1e-5, "silu_mul": True}
    got = skinny_linear(x, weight, tile=tile, rows_per_program=rows_per_program, **kwargs)
    assert_matches(got, skinny_linear_ref(x, weight, **kwargs))


@pytest.mark.parametrize("rows_per_program", [1, SKINNY_MAX_ROWS], ids=["row", "rows"])
def test_a_rows_output_does_not_depend_on_the_other_rows(rows_per_program):
    """The property async scheduling's padded steps and verify-vs-decode comparisons rely on: row m of a 4-row
    call is bit for bit row m alone (and among 2), whichever kernel, the norm and SwiGLU fused in."""
    gen = torch.Generator().manual_seed(3)
    x, weight = randn((4, 300), torch.bfloat16, gen), randn((2 * 40, 300), torch.bfloat16, gen) / 17
    kwargs = {"norm_weight": (1 + randn((300,), torch.bfloat16, gen) / 4).to(torch.bfloat16), "eps": 1e-5,
              "silu_mul": True, "rows_per_program": rows_per_program}
    four = skinny_linear(x, weight, **kwargs)
    for m in range(4):
        for rows in (slice(m, m + 1), slice(m // 2 * 2, m // 2 * 2 + 2)):
            torch.testing.assert_close(skinny_linear(x[rows], weight, **kwargs), four[rows], atol=0, rtol=0)
    residual = randn((4, 40), torch.bfloat16, gen)
    four = skinny_linear(x, weight[:40], residual=residual, rows_per_program=rows_per_program)
    for m in range(4):
        torch.testing.assert_close(skinny_linear(x[m:m + 1], weight[:40], residual=residual[m:m + 1],
                                                 rows_per_program=rows_per_program), four[m:m + 1], atol=0, rtol=0)


def test_more_rows_than_the_skinny_limit_are_refused():
    x = torch.zeros(SKINNY_MAX_ROWS + 1, 8)
    with pytest.raises(AssertionError):
        skinny_linear(x, torch.zeros(4, 8))


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    monkeypatch.setattr(research_lm.ops, "FUSED_DEVICE_TYPES", ("cuda", "cpu"))


def _count_skinny(monkeypatch) -> list[int]:
    import research_lm.ops.skinny_linear as mod

    calls = [0]
    real = mod.skinny_linear

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(mod, "skinny_linear", counted)
    return calls


@pytest.mark.parametrize("limit", [1, SKINNY_MAX_ROWS], ids=["row", "rows"])
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_decode_steps_of_a_few_rows_fuse_and_match_the_per_op_path(name, limit, tiny_checkpoint, kernels_on_cpu,
                                                                    monkeypatch):
    """A prefill (more rows than the limit: the per-op path), then decode steps of 2 rows (1 under skinny_rows=1,
    the one-row kernel): 4 skinny kernels per layer, and the logits of the per-op path (fused ops off) at every
    step."""
    model, hf_config = load_model(tiny_checkpoint(name), device=device(), dtype=torch.float32,
                                  attention_backend="torch_ref")
    set_skinny_rows(model, limit)
    rows = min(limit, 2)
    prompts, steps = [[3, 1, 4, 1, 5, 9, 2, 6], [5, 3]][:rows], [s[:rows] for s in ([7, 8], [2, 4], [1, 1])]

    def run() -> list[torch.Tensor]:
        batch = PagedBatch(model, [len(p) + len(steps) for p in prompts], block_size=4)
        out = batch.step(prompts)
        for step in steps:
            out += batch.step([[t] for t in step])
        return out

    calls = _count_skinny(monkeypatch)
    fused = run()
    assert calls[0] == 4 * hf_config.num_hidden_layers * len(steps)
    set_skinny_rows(model, 0)
    ref = run()
    assert calls[0] == 4 * hf_config.num_hidden_layers * len(steps)  # the knob reached the layers
    set_fused_ops(model, False)  # fused ops off: skinny_rows changes nothing, no skinny kernel runs
    torch_path = run()
    set_skinny_rows(model, limit)
    assert all(torch.equal(a, b) for a, b in zip(run(), torch_path, strict=True))
    assert calls[0] == 4 * hf_config.num_hidden_layers * len(steps)
    for got, want in zip(fused, ref, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_greedy_tokens_with_skinny_layers_equal_the_per_op_path(kernels_on_cpu, monkeypatch):
    """Through the engine (LLM(skinny_rows=4)), with EAGLE-3 drafting from hidden-state taps of skinny layers: the
    same tokens as without them, and the skinny kernels ran."""
    spec = {"method": "eagle3", "model": "tiny-llama-eagle3", "num_speculative_tokens": 2}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = ["def add(a, b):", "import os\n"]
    calls = _count_skinny(monkeypatch)
    outs = {}
    for rows in (SKINNY_MAX_ROWS, 0):
        llm = LLM("tiny-llama", device="cpu", max_model_len=64, max_num_seqs=1, skinny_rows=rows,
                  speculative_config=spec)
        before = calls[0]
        outs[rows] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert (calls[0] > before) == (rows > 0)
    assert outs[SKINNY_MAX_ROWS] == outs[0]


def test_skinny_rows_is_checked_and_defaults_to_batch_1_decode():
    from research_lm.api.config import EngineConfig

    assert EngineConfig().skinny_rows == 1
    with pytest.raises(ValueError, match=r"skinny_rows must be in \[0, 4\]"):
        EngineConfig(skinny_rows=SKINNY_MAX_ROWS + 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("limit", [1, SKINNY_MAX_ROWS], ids=["row", "rows"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_skinny_layers_on_cuda_give_the_per_op_paths_greedy_tokens(dtype, limit):
    """Issue 31's correctness rule on the GPU: continuous batching of 8 requests over at most `limit` rows (every
    decode step skinny, CUDA graphs on), token for token the per-op path's (skinny_rows=0) in float32; in bfloat16
    the two differ only in fp32 summation order, so all but near-ties agree (assert_greedy_agrees_up_to_near_ties)."""
    from tests.utils import assert_greedy_agrees_up_to_near_ties

    prompts = ["def fibonacci(n):", "import numpy as np\n", "class Stack:", "for i in range(10):", "# sort a list",
               "x = [", "while True:", "print("]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=2)
    outs = {}
    for rows in (limit, 0):
        llm = LLM("tiny-llama", device="cuda", dtype=dtype, max_num_seqs=limit, max_model_len=128, skinny_rows=rows)
        outs[rows] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    if dtype == "float32":
        assert [o.token_ids for o in outs[limit]] == [o.token_ids for o in outs[0]]
    else:
        assert_greedy_agrees_up_to_near_ties(outs[0], outs[limit], num_tokens=48)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows_per_program", [1, SKINNY_MAX_ROWS], ids=["row", "rows"])
@pytest.mark.parametrize("m", [1, 2, 4])
def test_skinny_linear_on_cuda_at_the_1b_shapes(m, rows_per_program):
    """The real kernels at Llama-3.2-1B's projection shapes (and their tuned tiles) against the per-op path."""
    gen = torch.Generator().manual_seed(m)
    for rows, k, fusion in ((3072, 2048, "norm"), (2048, 2048, "residual"), (16384, 2048, "norm_silu_mul"),
                            (2048, 8192, "residual")):
        n = rows // 2 if "silu" in fusion else rows
        x = randn((m, k), torch.bfloat16, gen)
        weight = randn((rows, k), torch.bfloat16, gen) / k**0.5
        kwargs = {"norm_weight": (1 + randn((k,), torch.bfloat16, gen) / 4).to(torch.bfloat16) if "norm" in fusion
                  else None, "eps": 1e-5, "silu_mul": "silu" in fusion,
                  "residual": randn((m, n), torch.bfloat16, gen) if fusion == "residual" else None}
        got = skinny_linear(x, weight, rows_per_program=rows_per_program, **kwargs)
        assert_matches(got, skinny_linear_ref(x, weight, **kwargs))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows_per_program", [1, SKINNY_MAX_ROWS], ids=["row", "rows"])
def test_on_cuda_a_rows_output_does_not_depend_on_the_other_rows(rows_per_program):
    """The compiled kernels keep a row's bits whatever else the step holds (the interpreter cannot show how the GPU
    reduces): each row of 4, at gate_up's and down's 1B shapes, bit for bit the row alone and among 2."""
    gen = torch.Generator().manual_seed(5)
    for rows, k, kwargs in ((16384, 2048, {"silu_mul": True}), (2048, 8192, {})):
        x, weight = randn((4, k), torch.bfloat16, gen), randn((rows, k), torch.bfloat16, gen) / k**0.5
        if kwargs:
            kwargs["norm_weight"], kwargs["eps"] = (1 + randn((k,), torch.bfloat16, gen) / 4).to(torch.bfloat16), 1e-5
        four = skinny_linear(x, weight, rows_per_program=rows_per_program, **kwargs)
        for m in range(4):
            for part in (slice(m, m + 1), slice(m // 2 * 2, m // 2 * 2 + 2)):
                got = skinny_linear(x[part], weight, rows_per_program=rows_per_program, **kwargs)
                torch.testing.assert_close(got, four[part], atol=0, rtol=0)
