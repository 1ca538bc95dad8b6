"""Batch-invariant mode: the invariant linear kernel against F.linear, a row's bits whatever M and the other rows,
the triton backend's invariant attention plan (a row's output the same in decode, verify, prefill chunks and
batches), the switch's wiring and what it refuses.

Without CUDA the kernels run under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1); the tests
that go through layers add "cpu" to the device types the kernels serve. With CUDA they run on the device.
The end-to-end proofs (bf16, graphs, batches of 64, speculation) are tests/test_batch_invariant_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import research_lm.ops
from attention_zoo.base import AttentionSpec
from attention_zoo.layer import Attention
from attention_zoo.metadata import CommonAttentionMetadata
from attention_zoo.triton_attn import TritonAttentionBackend
from research_lm import LLM, SamplingParams
from research_lm.api.config import EngineConfig
from research_lm.models import load_model
from research_lm.models.layers import Linear, RMSNorm, VocabParallelEmbedding
from research_lm.ops import batch_invariant as bi
from research_lm.ops import set_batch_invariant
from tests.attention_zoo.paged_cases import make_case
from tests.ops.cases import DTYPES, assert_matches, device, randn
from tests.utils import forward_prefill

ON_CUDA = torch.cuda.is_available()


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    monkeypatch.setattr(research_lm.ops, "FUSED_DEVICE_TYPES", ("cuda", "cpu"))


# ---------------------------------------------------------------- the linear kernel


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k", [(1, 40, 24), (5, 33, 100), (70, 130, 72)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_f_linear(dtype, m, n, k, with_bias):
    """x W^T + b accumulated in fp32 and rounded once to x's dtype: F.linear's numbers."""
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = randn((m, k), dtype, gen), randn((n, k), dtype, gen) * 0.2
    b = randn((n,), dtype, gen) if with_bias else None
    want = F.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype)
    assert_matches(bi.linear(x, w, b), want)


def test_linear_reads_strided_rows():
    gen = torch.Generator().manual_seed(1)
    wide = randn((6, 50), torch.float32, gen)
    w = randn((20, 32), torch.float32, gen)
    x = wide[:, 3:35]  # rows at stride 50
    torch.testing.assert_close(bi.linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_bits_do_not_depend_on_m_or_the_other_rows(dtype):
    """The same row alone, among 2, 16, 63 or 129 others at different places (other M tiles too): the same bits."""
    gen = torch.Generator().manual_seed(2)
    n, k = 48, 200  # several K steps
    w, b = randn((n, k), dtype, gen) * 0.1, randn((n,), dtype, gen)
    row = randn((1, k), dtype, gen)
    alone = bi.linear(row, w, b)
    for m, place in [(3, 1), (17, 16), (64, 63), (130, 0), (130, 65), (130, 129)]:
        x = randn((m, k), dtype, gen) * 10
        x[place] = row[0]
        assert torch.equal(bi.linear(x, w, b)[place], alone[0]), (m, place)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_split_k_sums_its_ranges_in_order_whatever_m(dtype):
    """K cut into 3 ranges (partial sums added in order by a second kernel): F.linear's numbers, and a row's bits
    the same alone and among others, with and without a bias."""
    gen = torch.Generator().manual_seed(3)
    n, k = 40, 200
    config = bi.LinearConfig(block_m=16, block_n=16, block_k=32, split_k=3)
    w, b = randn((n, k), dtype, gen) * 0.1, randn((n,), dtype, gen)
    x = randn((37, k), dtype, gen)
    for bias in (None, b):
        want = F.linear(x.float(), w.float(), None if bias is None else bias.float()).to(dtype)
        assert_matches(bi.linear(x, w, bias, config=config), want)
        alone = bi.linear(x[20:21], w, bias, config=config)
        assert torch.equal(bi.linear(x, w, bias, config=config)[20], alone[0])


def test_linear_tile_follows_the_weight_only():
    """The tile comes from (N, K, dtype): M is not an argument, and no step's M enters the compile key."""
    assert bi.linear_config(128256, 4096, torch.bfloat16).block_n == 128
    assert bi.linear_config(2048, 2048, torch.bfloat16).block_n == 16
    assert bi.linear_config(64, 20, torch.float32).block_k == 32
    assert [bi.linear_config(2048, k, torch.bfloat16).split_k for k in (2048, 8192, 14336, 65536)] == [1, 4, 7, 8]
    kernel = bi._linear_kernel
    options = getattr(kernel, "kwargs", None) or {"do_not_specialize": kernel.do_not_specialize}
    assert "M" in list(options["do_not_specialize"])


def test_a_tuned_tile_serves_its_gpu_and_shape_only(tmp_path, monkeypatch):
    """TUNED_CONFIGS' tile for (GPU model, N, K) replaces the rule there, in 16 bits; other GPUs, other shapes and
    fp32 keep the rule. The sweep's writer merges a GPU's tiles beside other GPUs' (bench_invariant_gemm)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))
    from bench_invariant_gemm import write_tuned

    path = tmp_path / "tuned.json"
    tile = bi.LinearConfig(block_m=64, block_n=32, block_k=128, split_k=2, num_warps=8, num_stages=4)
    write_tuned(path, "GPU A", {(3072, 2048): (tile, {1: 10.0}, {1: 9.0})})
    write_tuned(path, "GPU B", {(3072, 2048): (bi.LinearConfig(64, 16, 64), {1: 10.0}, {1: 9.0})})
    monkeypatch.setattr(bi, "TUNED_CONFIGS", path)
    bi.tuned_configs.cache_clear()
    try:
        rule = bi.linear_config(3072, 2048, torch.bfloat16)
        assert bi.linear_config(3072, 2048, torch.bfloat16, "GPU A") == tile
        assert bi.linear_config(3072, 2048, torch.float16, "GPU A") == tile
        assert bi.linear_config(3072, 2048, torch.bfloat16, "GPU B").block_n == 16
        assert bi.linear_config(3072, 2048, torch.float32, "GPU A") == bi.linear_config(3072, 2048, torch.float32)
        assert bi.linear_config(3072, 2048, torch.bfloat16, "GPU C") == rule
        assert bi.linear_config(2048, 2048, torch.bfloat16, "GPU A") == bi.linear_config(2048, 2048, torch.bfloat16)
    finally:
        bi.tuned_configs.cache_clear()


# ---------------------------------------------------------------- attention


def _spec(sliding_window: int | None = None) -> AttentionSpec:
    return AttentionSpec(num_heads=4, num_kv_heads=2, head_size=16, scale=0.25, sliding_window=sliding_window)


def test_attention_plan_ignores_the_step():
    """Decode over a long context (where the default plan splits the keys) and a prefill chunk plan alike."""
    kw = dict(num_heads=4, num_kv_heads=2, head_size=16, block_size=16, dtype=torch.float32, device=device())
    decode = make_case([1], [600], **kw).common
    prefill = make_case([40, 3], [40, 70], **kw).common
    plans = [TritonAttentionBackend.build_metadata(c).plan(_spec(), batch_invariant=True) for c in (decode, prefill)]
    assert plans[0] == plans[1] and plans[0].num_splits == 1
    default = [TritonAttentionBackend.build_metadata(c).plan(_spec()) for c in (decode, prefill)]
    assert default[0].num_splits > 1  # what the invariant plan gives up


class _Paged:
    """One cache holding a target request's context (blocks 1..) and filler requests' (later blocks)."""

    BS = 16

    def __init__(self, context: int, dtype: torch.dtype, gen: torch.Generator):
        self.dtype, self.gen = dtype, gen
        self.target_blocks = list(range(1, -(-context // self.BS) + 1))
        self.num_blocks = len(self.target_blocks) + 8
        self.cache = (torch.randn(2, self.num_blocks, self.BS, 2, 16, generator=gen)).to(dtype).to(device())
        self.q = torch.randn(4, 16, generator=gen).to(dtype).to(device())  # the target token's query

    def run(self, requests: list[tuple[int, int]], target: int, target_row: int, window: int | None) -> torch.Tensor:
        """requests: (query_len, seq_len) per request; request `target` reads the target's blocks, its query row
        `target_row` is the target token. Returns the target token's output [num_heads, head_size]."""
        filler = iter(range(len(self.target_blocks) + 1, self.num_blocks))
        table = torch.zeros(len(requests), len(self.target_blocks), dtype=torch.int32)
        for i, (_, seq_len) in enumerate(requests):
            blocks = self.target_blocks if i == target else [next(filler) for _ in range(-(-seq_len // self.BS))]
            table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        qlens = [q for q, _ in requests]
        qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
        seq = torch.tensor([s for _, s in requests], dtype=torch.int32)
        tokens = int(qsl[-1])
        common = CommonAttentionMetadata(
            query_start_loc=qsl.to(device()), query_start_loc_cpu=qsl, seq_lens=seq.to(device()), seq_lens_cpu=seq,
            num_computed_tokens_cpu=seq - torch.tensor(qlens, dtype=torch.int32), block_table=table.to(device()),
            slot_mapping=torch.full((tokens,), -1, dtype=torch.int64, device=device()),  # the cache is pre-filled
            request_rows=torch.arange(len(requests), dtype=torch.int32, device=device()), num_reqs=len(requests),
            num_tokens=tokens, max_query_len=max(qlens), max_seq_len=int(seq.max()), block_size=self.BS,
        )
        q = torch.randn(tokens, 4, 16, generator=self.gen).to(self.dtype).to(device())
        index = int(qsl[target]) + target_row
        q[index] = self.q
        kv = torch.zeros(tokens, 2, 16, dtype=self.dtype, device=device())
        impl = TritonAttentionBackend.make_impl(_spec(window))
        impl.batch_invariant = True
        return impl.forward(q, kv, kv, self.cache, TritonAttentionBackend.build_metadata(common))[index]


@pytest.mark.parametrize("window", [None, 24])
def test_an_attention_rows_bits_do_not_depend_on_the_step(window):
    """The target token at position 44 (45 keys): decoded alone, first of a 4-token verify step, last of a 20-token
    prefill chunk, and beside other requests (prefill, decode) before and after it: the same bits."""
    dtype = torch.bfloat16 if ON_CUDA else torch.float32
    paged = _Paged(context=48, dtype=dtype, gen=torch.Generator().manual_seed(3))
    alone = paged.run([(1, 45)], target=0, target_row=0, window=window)
    cases = {
        "verify": ([(4, 48)], 0, 0),
        "prefill chunk": ([(20, 45)], 0, 19),
        "batch": ([(7, 30), (1, 19), (4, 48), (1, 5)], 2, 0),
        "batch, decode": ([(5, 5), (1, 45), (3, 33)], 1, 0),
    }
    for name, (requests, target, row) in cases.items():
        assert torch.equal(paged.run(requests, target, row, window), alone), name


# ---------------------------------------------------------------- the switch


def test_the_switch_reaches_linear_layers_the_head_norms_and_attention(tiny_checkpoint, kernels_on_cpu, monkeypatch):
    """With the switch on, every projection and the LM head run the invariant kernel and the norms the Triton one
    (fused_ops off too); the logits stay F.linear's; switched off, nothing takes them."""
    model, hf_config = load_model(tiny_checkpoint("llama"), device=device(), dtype=torch.float32,
                                  attention_backend="triton")
    seqs = [[3, 1, 4, 1, 5, 9, 2, 6], [5, 3]]
    research_lm.ops.set_fused_ops(model, False)
    want = forward_prefill(model, seqs, block_size=4)
    calls = {"linear": 0}
    real = bi.linear

    def counted(*args, **kwargs):
        calls["linear"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(bi, "linear", counted)
    set_batch_invariant(model, True)
    switchable = [m for m in model.modules() if isinstance(m, Linear | RMSNorm | VocabParallelEmbedding | Attention)]
    assert switchable and all(m.batch_invariant for m in switchable)
    assert all(m.impl.batch_invariant for m in model.modules() if isinstance(m, Attention))
    got = forward_prefill(model, seqs, block_size=4)
    assert calls["linear"] == 4 * hf_config.num_hidden_layers + 1  # qkv, o, gate_up, down per layer; the head
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    set_batch_invariant(model, False)
    forward_prefill(model, seqs, block_size=4)
    assert calls["linear"] == 4 * hf_config.num_hidden_layers + 1


def test_cpu_tensors_keep_the_torch_path():
    layer = Linear(8, 4)
    layer.batch_invariant = True
    assert not research_lm.ops.use_batch_invariant(layer, torch.zeros(1, 8))


def test_the_env_var_turns_it_on(monkeypatch):
    assert not EngineConfig().batch_invariant
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert EngineConfig().batch_invariant and EngineConfig(batch_invariant=False).batch_invariant
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    assert not EngineConfig().batch_invariant


@pytest.mark.parametrize("knobs, message", [
    (dict(compile=True), "batch_invariant=True does not combine with compile=True"),
    (dict(tensor_parallel_size=2), "batch_invariant=True does not combine with tensor_parallel_size=2"),
])
def test_the_config_refuses_what_no_model_can_meet(knobs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(batch_invariant=True, **knobs)


def test_the_engine_refuses_a_backend_that_cannot(kernels_on_cpu):
    message = (r"^batch_invariant=True: attention backend 'torch_ref' \(attention layers\) is not batch-invariant; "
               r"backends that are, for attention layers: \['triton'\]$")
    with pytest.raises(ValueError, match=message):
        LLM("tiny-llama", device="cpu", attention_backend="torch_ref", batch_invariant=True, max_model_len=64)


@pytest.mark.parametrize("name, message", [
    ("mixtral", "fused MoE experts are not batch-invariant"),
    # "triton" names mla_triton for MLA layers on CUDA, the torch reference on CPU: neither is invariant
    ("deepseek-v2", r"attention backend 'mla_(torch_ref|triton)' \(mla layers\) is not batch-invariant; backends "
                    r"that are, for mla layers: none"),
])
def test_moe_and_mla_are_refused(name, message, tiny_checkpoint):
    device = "cuda" if torch.cuda.is_available() else "cpu"  # triton runs on CPU only under the interpreter
    model, _ = load_model(tiny_checkpoint(name), device=device, dtype=torch.float32, attention_backend="triton")
    with pytest.raises(ValueError, match=message):
        bi.check_batch_invariant([model])


def test_llm_runs_on_cpu_with_the_switch_and_reaches_the_drafter():
    """On CPU the switch changes no number: the same tokens as without it, EAGLE-3 drafting included."""
    spec = {"method": "eagle3", "model": "tiny-llama-eagle3", "num_speculative_tokens": 2}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = ["def parse(", "import os\n"]
    want = [o.outputs[0].token_ids for o in LLM("tiny-llama", device="cpu").generate(prompts, params, use_tqdm=False)]
    llm = LLM("tiny-llama", device="cpu", batch_invariant=True, speculative_config=spec)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    drafter = llm.engine.runner.proposer.head
    assert all(m.batch_invariant for m in drafter.modules() if isinstance(m, Linear | RMSNorm))


def test_the_cli_passes_batch_invariant():
    from hydra import compose, initialize_config_dir

    from research_lm.harness.experiment import engine_config
    from tests.experiments.conftest import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        on = compose("config", overrides=["runner.batch_invariant=true"])
        off = compose("config")
    assert engine_config(on).batch_invariant and not engine_config(off).batch_invariant
