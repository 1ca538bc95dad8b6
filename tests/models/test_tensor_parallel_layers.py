"""Tensor-parallel layers (research_lm/models/layers.py) in one process: every rank's loader slices the full
checkpoint tensor, and the ranks' outputs, put together as their collective would (summed after a row-parallel
layer and the embedding, side by side after the LM head), equal the whole layer's; a model whose sizes do not split,
or a family that cannot split, is refused at build time with a sentence naming the field."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from research_lm.models import build_model
from research_lm.models.layers import (
    ColumnParallelLinear,
    GatedMLP,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    compute_logits,
)
from research_lm.worker.parallel import TensorParallel

H = 16


@dataclass(frozen=True)
class Alone(TensorParallel):
    """Rank `rank` of `size` without peers: collectives return this rank's part, which the test combines."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _ranks(size: int) -> list[Alone]:
    return [Alone(None, rank, size) for rank in range(size)]


def _load(module: torch.nn.Module, tensors: dict[str, torch.Tensor], shard_ids: dict[str, object] | None = None):
    params = dict(module.named_parameters())
    for name, t in tensors.items():
        target = name.split(":")[0]
        params[target].weight_loader(params[target], t, (shard_ids or {}).get(name))
    return module


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("size", [2, 4])
def test_column_row_and_mlp_shards_add_up(size):
    x, w, b = _rand(5, H), _rand(24, H, seed=1), _rand(24, seed=2)
    whole = torch.nn.functional.linear(x, w, b)
    cols = [_load(ColumnParallelLinear(H, 24, True, tp), {"weight": w, "bias": b})(x) for tp in _ranks(size)]
    torch.testing.assert_close(torch.cat(cols, dim=-1), whole)

    w_row, b_row = _rand(H, 24, seed=3), _rand(H, seed=4)
    y = _rand(5, 24, seed=5)
    parts = [_load(RowParallelLinear(24, H, True, tp), {"weight": w_row, "bias": b_row}) for tp in _ranks(size)]
    summed = sum(p(y[:, p.tp.rank * 24 // size : (p.tp.rank + 1) * 24 // size]) - p.bias for p in parts)
    torch.testing.assert_close(summed + b_row, torch.nn.functional.linear(y, w_row, b_row))  # the bias once

    gate, up, down = _rand(32, H, seed=6), _rand(32, H, seed=7), _rand(H, 32, seed=8)
    ckpt = {"gate_up_proj.weight:g": gate, "gate_up_proj.weight:u": up, "down_proj.weight": down}
    ids = {"gate_up_proj.weight:g": 0, "gate_up_proj.weight:u": 1}
    mlp = _load(GatedMLP(H, 32), ckpt, ids)
    shards = [_load(GatedMLP(H, 32, tp=tp), ckpt, ids) for tp in _ranks(size)]
    assert shards[0].gate_up_proj.weight.shape == (2 * 32 // size, H)
    torch.testing.assert_close(sum(m(x) for m in shards), mlp(x))


@pytest.mark.parametrize("size,kv_heads,kv_of_rank", [(2, 2, [0, 1]), (4, 2, [0, 0, 1, 1]), (4, 1, [0, 0, 0, 0]),
                                                      (2, 4, [[0, 1], [2, 3]])])
def test_qkv_shards_take_their_heads(size, kv_heads, kv_of_rank):
    """Query heads split evenly; KV heads too, or (fewer KV heads than ranks) each rank holds the one its query
    heads read: query head h reads KV head h // (heads / kv_heads)."""
    heads, hd = 4, 4
    q, k, v = _rand(heads * hd, H), _rand(kv_heads * hd, H, seed=1), _rand(kv_heads * hd, H, seed=2)
    stacked = torch.cat([q, k, v])
    for tp, kv_ids in zip(_ranks(size), kv_of_rank, strict=True):
        kv_ids = kv_ids if isinstance(kv_ids, list) else [kv_ids]
        by_shard = _load(QKVParallelLinear(H, hd, heads, kv_heads, tp=tp), {"weight:q": q, "weight:k": k,
                         "weight:v": v}, {"weight:q": "q", "weight:k": "k", "weight:v": "v"})
        whole = _load(QKVParallelLinear(H, hd, heads, kv_heads, tp=tp), {"weight": stacked})  # a stacked checkpoint
        assert torch.equal(by_shard.weight, whole.weight)
        my_q = list(range(tp.rank * heads // size, (tp.rank + 1) * heads // size))
        assert all(h * kv_heads // heads in kv_ids for h in my_q)  # its query heads read its KV heads
        rows = lambda t, ids: torch.cat([t[i * hd : (i + 1) * hd] for i in ids])  # noqa: E731
        assert torch.equal(by_shard.weight, torch.cat([rows(q, my_q), rows(k, kv_ids), rows(v, kv_ids)]))
        assert (by_shard.num_heads, by_shard.num_kv_heads) == (len(my_q), len(kv_ids))


@pytest.mark.parametrize("size", [2, 4])
def test_vocab_parallel_embedding_and_lm_head(size):
    vocab = 32
    table, head = _rand(vocab, H), _rand(vocab, H, seed=1)
    ids = torch.tensor([0, 7, 8, 31, 16, 7])
    embeds = [_load(VocabParallelEmbedding(vocab, H, tp), {"weight": table}) for tp in _ranks(size)]
    torch.testing.assert_close(sum(e(ids) for e in embeds), table[ids])  # each id from exactly one rank
    hidden = _rand(3, H, seed=2)
    heads = [_load(ParallelLMHead(vocab, H, tp), {"weight": head}) for tp in _ranks(size)]
    gathered = torch.cat([compute_logits(h, hidden) for h in heads], dim=-1)  # rank order = vocabulary order
    torch.testing.assert_close(gathered, hidden @ head.T)


def _build(name: str, size: int, **overrides):
    """TINY_MODELS[name]'s model as rank 0 of `size`, weights uninitialized."""
    import transformers

    from tests.conftest import TINY_MODELS, TINY_SHAPE

    spec = TINY_MODELS[name]
    cfg = getattr(transformers, spec.config_class)(**{**TINY_SHAPE, **spec.overrides, **overrides})
    cfg.architectures = [spec.config_class.replace("Config", "ForCausalLM")]
    return build_model(cfg, device="cpu", dtype=torch.float32, attention_backend="torch_ref", tp=Alone(None, 0, size))


@pytest.mark.parametrize("name,size,overrides,message", [
    ("llama", 3, {"vocab_size": 258}, r"num_attention_heads \(4\) is not divisible by tensor_parallel_size \(3\)"),
    ("llama", 2, {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3},
     r"num_key_value_heads \(3\) neither divides nor is divisible by tensor_parallel_size \(2\)"),
    ("llama", 4, {"hidden_size": 96, "num_attention_heads": 12, "num_key_value_heads": 3, "head_dim": 8},
     r"num_key_value_heads \(3\) neither divides nor is divisible by tensor_parallel_size \(4\)"),
    ("llama", 2, {"vocab_size": 255}, r"vocab_size \(255\) is not divisible by tensor_parallel_size \(2\)"),
    ("qwen3", 4, {"intermediate_size": 130}, r"intermediate_size \(130\) is not divisible"),
    ("deepseek-v2", 3, {"vocab_size": 258}, r"num_attention_heads \(4\) is not divisible"),
    ("mamba2", 3, {"vocab_size": 258}, r"^num_heads \(8\) is not divisible by tensor_parallel_size \(3\)$"),
    ("mamba2", 4, {"num_heads": 12, "n_groups": 6, "expand": 3},
     r"^n_groups \(6\) neither divides nor is divisible by tensor_parallel_size \(4\)$"),
    ("bamba", 3, {"vocab_size": 258, "intermediate_size": 96},
     r"^mamba_n_heads \(8\) is not divisible by tensor_parallel_size \(3\)$"),
    ("bamba", 4, {"mamba_n_heads": 12, "mamba_n_groups": 6, "mamba_expand": 3},
     r"^mamba_n_groups \(6\) neither divides nor is divisible by tensor_parallel_size \(4\)$"),
])
def test_sizes_that_do_not_split_are_refused(name, size, overrides, message):
    with pytest.raises(ValueError, match=message):
        _build(name, size, **overrides)


def test_a_model_builds_with_a_share_of_the_heads():
    model = _build("llama", 2)
    attn = model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads, attn.attn.spec.num_heads, attn.attn.spec.num_kv_heads) == (2, 1, 2, 1)
    assert model.lm_head.weight.shape[0] == 128 and model.model.embed_tokens.weight.shape[0] == 128


@pytest.mark.parametrize("name,size,heads,groups,split_group", [
    ("mamba2", 2, 4, 1, True), ("mamba2-groups", 2, 4, 1, False), ("mamba2-groups", 4, 2, 1, True),
    ("bamba", 4, 2, 1, True),
])
def test_a_mamba_mixer_builds_with_a_share_of_the_heads(name, size, heads, groups, split_group):
    """8 SSM heads of 16, state 16: each rank's in_proj rows (z, x, B, C, dt), conv channels (x, B, C) and state
    slots hold its heads and the groups they read; the gated norm all-reduces where a group spans ranks."""
    model = _build(name, size)
    layer = model.model.layers[0] if name == "bamba" else model.backbone.layers[0]
    mixer = layer.mamba if name == "bamba" else layer.mixer
    spec = mixer.ssm.spec
    assert (spec.num_heads, spec.n_groups, mixer.norm.split_group) == (heads, groups, split_group)
    xbc = heads * 16 + 2 * groups * 16
    assert mixer.in_proj.weight.shape[0] == heads * 16 + xbc + heads and mixer.conv1d.weight.shape[0] == xbc
    assert spec.ssm_state_shape(1) == (1, heads, 16, 16) and spec.conv_state_shape(1) == (1, 3, xbc)
    assert mixer.out_proj.weight.shape[1] == heads * 16 and mixer.A_log.shape == (heads,)
