"""MLA reference backend: equals dense attention over up-projected latents; absorbed decode == naive decode.

The oracle here is written independently of attention_zoo/mla.py: float64, per request, from the
unpaged latents of the whole sequence: K_h = [W_UK[h] c ; k_pe], V_h = W_UV[h] c, causal softmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from attention_zoo import AttentionSpec, CommonAttentionMetadata, get_backend, select_backend
from attention_zoo.mla import MLASpec, build_mla_metadata

L, NOPE, R, V = 24, 16, 8, 12  # latent, nope, rope, value dims (L not a power of 2; V != NOPE)


@dataclass
class MLACase:
    spec: MLASpec
    q: torch.Tensor  # [num_tokens + pad, H, NOPE + R]
    kv_c: torch.Tensor  # [num_tokens + pad, L]: this step's latents
    k_pe: torch.Tensor  # [num_tokens + pad, R]
    kv_b_weight: torch.Tensor  # [H * (NOPE + V), L]
    kv_cache: torch.Tensor  # [num_blocks, block_size, L + R], earlier context pre-filled, the rest noise
    common: CommonAttentionMetadata
    latents: list[torch.Tensor]  # per request [seq_len, L + R]: the whole sequence (context, then this step)

    @property
    def num_real_tokens(self) -> int:
        return int(self.common.query_start_loc_cpu[-1])


def make_mla_case(
    query_lens: list[int],
    seq_lens: list[int],  # context after this step, >= query length
    *,
    num_heads: int = 4,
    block_size: int = 4,
    dtype: torch.dtype = torch.float32,
    kv_lora_rank: int = L,
    rope_dim: int = R,
    pad_tokens: int = 0,  # rows past the batch (CUDA-graph padding), slot -1
    device: str = "cpu",
    seed: int = 0,
) -> MLACase:
    """Each request's pages are a random set of blocks (block 0 is null); unused cache rows hold noise."""
    g = torch.Generator().manual_seed(seed)
    width = kv_lora_rank + rope_dim
    pages = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(pages) + 2
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    block_table = torch.zeros(len(seq_lens), max(pages) + 1, dtype=torch.int32)
    kv_cache = torch.randn(num_blocks, block_size, width, generator=g)
    latents, new_latents, slots = [], [], []
    for r, (n, s) in enumerate(zip(query_lens, seq_lens)):
        block_table[r, : pages[r]] = torch.tensor(ids[: pages[r]], dtype=torch.int32)
        ids = ids[pages[r]:]
        lat = torch.randn(s, width, generator=g).to(dtype)
        latents.append(lat)
        for p in range(s):
            slot = int(block_table[r, p // block_size]) * block_size + p % block_size
            if p < s - n:
                kv_cache.view(-1, width)[slot] = lat[p].float()
            else:
                slots.append(slot)
                new_latents.append(lat[p])
    num_tokens = len(slots)
    new = torch.stack(new_latents) if new_latents else torch.zeros(0, width, dtype=dtype)
    new = torch.cat([new, torch.randn(pad_tokens, width, generator=g).to(dtype)])
    spec = MLASpec.from_dims(num_heads=num_heads, kv_lora_rank=kv_lora_rank, qk_nope_head_dim=NOPE,
                             qk_rope_head_dim=rope_dim, v_head_dim=V, scale=0.3)  # fmt: skip
    q = torch.randn(num_tokens + pad_tokens, num_heads, NOPE + rope_dim, generator=g).to(dtype)
    kv_b = (torch.randn(num_heads * (NOPE + V), kv_lora_rank, generator=g) * kv_lora_rank**-0.5).to(dtype)
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens).cumsum(0)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=seq_lens_t.to(device),
        seq_lens_cpu=seq_lens_t, num_computed_tokens_cpu=seq_lens_t - qsl.diff(),
        block_table=block_table.to(device),
        slot_mapping=torch.tensor(slots + [-1] * pad_tokens, dtype=torch.int64, device=device),
        request_rows=torch.arange(len(query_lens), dtype=torch.int32, device=device),
        num_reqs=len(query_lens), num_tokens=num_tokens + pad_tokens, max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), block_size=block_size,
    )  # fmt: skip
    return MLACase(
        spec=spec, q=q.to(device), kv_c=new[:, :kv_lora_rank].to(device), k_pe=new[:, kv_lora_rank:].to(device),
        kv_b_weight=kv_b.to(device), kv_cache=kv_cache.to(dtype).to(device), common=common, latents=latents,
    )


def run_mla_backend(name: str, case: MLACase, **build_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [num_tokens + pad, H, V], the cache after the step), on a copy of the case's cache."""
    backend = get_backend(name)
    cache = case.kv_cache.clone()
    meta = backend.build_metadata(case.common, **build_kwargs)
    out = backend.make_impl(case.spec).forward(case.q, case.kv_c, case.k_pe, case.kv_b_weight, cache, meta)
    return out, cache


def dense_oracle(case: MLACase) -> torch.Tensor:  # [num_real_tokens, H, V] float64
    spec, outs = case.spec, []
    qsl = case.common.query_start_loc_cpu.tolist()
    w = case.kv_b_weight.double().cpu().view(spec.num_heads, NOPE + V, spec.kv_lora_rank)
    for i, lat in enumerate(case.latents):
        q = case.q[qsl[i] : qsl[i + 1]].double().cpu()
        n, s = q.shape[0], lat.shape[0]
        c, k_pe = lat.double()[:, : spec.kv_lora_rank], lat.double()[:, spec.kv_lora_rank :]
        k = torch.cat([torch.einsum("hnl,sl->hsn", w[:, :NOPE], c), k_pe.expand(spec.num_heads, s, -1)], dim=-1)
        v = torch.einsum("hvl,sl->hsv", w[:, NOPE:], c)
        scores = torch.einsum("qhd,hsd->hqs", q, k) * spec.scale
        allowed = torch.arange(s)[None, :] <= torch.arange(s - n, s)[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(torch.einsum("hqs,hsv->qhv", scores.softmax(-1), v))
    return torch.cat(outs)


# Fresh prefill across blocks; a chunk after cached context; decodes at, before and after block
# boundaries (seq_len 4, 5, 8, 9 with blocks of 4); a length-1 first prompt; an idle request.
MIXED = ([7, 5, 1, 1, 1, 1, 0, 1], [7, 11, 4, 5, 8, 9, 6, 1])


@pytest.mark.parametrize("decode_query_len", [0, 1, 8])  # 0: all naive; 8: every request absorbed
def test_reference_matches_dense_attention(decode_query_len):
    case = make_mla_case(*MIXED, pad_tokens=2)
    out, cache = run_mla_backend("mla_torch_ref", case, decode_query_len=decode_query_len)
    n = case.num_real_tokens
    torch.testing.assert_close(out[:n].double(), dense_oracle(case), atol=1e-5, rtol=1e-5)
    assert out[n:].abs().max() == 0  # padding rows are not attended for
    # this step's latents landed in their slots; nothing else moved (the padding was not written)
    expected = case.kv_cache.clone().view(-1, L + R)
    expected[case.common.slot_mapping[:n]] = torch.cat([case.kv_c, case.k_pe], -1)[:n]
    torch.testing.assert_close(cache.view(-1, L + R), expected, atol=0, rtol=0)


def test_absorbed_decode_equals_naive_decode():
    """The same decode batch through both paths: W_UK / W_UV absorbed or K / V up-projected."""
    case = make_mla_case([1, 1, 1, 3], [1, 9, 30, 12], num_heads=8, seed=3)
    naive, _ = run_mla_backend("mla_torch_ref", case, decode_query_len=0)
    absorbed, _ = run_mla_backend("mla_torch_ref", case, decode_query_len=3)
    assert build_mla_metadata(case.common, 3).prefill_reqs == []
    torch.testing.assert_close(absorbed, naive, atol=2e-6, rtol=2e-6)


def test_half_precision_tracks_fp32():
    case = make_mla_case(*MIXED, dtype=torch.float16, seed=5)
    out, _ = run_mla_backend("mla_torch_ref", case)
    torch.testing.assert_close(out[: case.num_real_tokens].double(), dense_oracle(case), atol=5e-3, rtol=5e-3)


def test_metadata_splits_requests_and_lays_out_decode_rows():
    common = make_mla_case([3, 1, 0, 2, 1], [10, 4, 5, 6, 1]).common
    meta = build_mla_metadata(common, decode_query_len=2)
    assert meta.prefill_reqs == [0] and meta.decode_reqs == [1, 3, 4]
    assert meta.decode_token_idx.tolist() == [3, 4, 5, 6]  # tokens 0-2: request 0; request 2 is idle
    assert meta.decode_req_idx.tolist() == [1, 3, 3, 4]
    assert meta.decode_kv_lens.tolist() == [4, 5, 6, 1]  # request 3: positions 4 and 5, causal
    assert meta.max_decode_kv_len == 6 and meta.num_decode_tokens == 4 and not meta.all_decode
    pure = build_mla_metadata(make_mla_case([1, 1], [3, 8]).common)
    assert pure.all_decode and pure.prefill_reqs == [] and pure.decode_token_idx.tolist() == [0, 1]


def test_latent_cache_is_one_head_and_smaller_than_dense_gqa():
    """DeepSeek-V2/V3 shapes: 576 values per token per layer vs 2 * 8 KV heads * 128 for a GQA layer."""
    spec = MLASpec.from_dims(num_heads=128, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                             v_head_dim=128, scale=192**-0.5)  # fmt: skip
    assert spec.kind == "mla" and spec.num_kv_heads == 1 and spec.head_size == 576
    assert spec.page_size_bytes(16, torch.bfloat16) == 16 * (512 + 64) * 2  # no K/V doubling
    gqa = AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128, scale=1.0)
    assert gqa.page_size_bytes(16, torch.bfloat16) == 2 * 16 * 8 * 128 * 2
    assert spec.page_size_bytes(16, torch.bfloat16) < gqa.page_size_bytes(16, torch.bfloat16)
    backend = get_backend("mla_torch_ref")
    cache = backend.allocate_cache(spec, num_blocks=3, block_size=16, num_slots=1, dtype=torch.bfloat16,
                                   device=torch.device("cpu"))  # fmt: skip
    assert cache.shape == (3, 16, 576)
    assert cache.numel() * cache.element_size() == 3 * spec.page_size_bytes(16, torch.bfloat16)


def test_backends_refuse_the_other_kind_with_a_sentence():
    mla = MLASpec.from_dims(num_heads=4, kv_lora_rank=L, qk_nope_head_dim=NOPE, qk_rope_head_dim=R,
                            v_head_dim=V, scale=1.0)  # fmt: skip
    with pytest.raises(ValueError, match=r"does not implement mla layers.*mla_torch_ref"):
        select_backend("torch_ref", mla, torch.device("cpu"), torch.float32)
    dense = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=16, scale=1.0)
    with pytest.raises(ValueError, match=r"does not implement attention layers.*torch_ref"):
        select_backend("mla_torch_ref", dense, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="one latent head"):
        MLASpec(num_heads=4, num_kv_heads=4, head_size=32, scale=1.0, kv_lora_rank=L, qk_rope_head_dim=R)
