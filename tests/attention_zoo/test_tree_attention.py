"""Token-tree attention (`CommonAttentionMetadata.tree_bits`) and `AttentionBackend.move_slots`.

A verify step's query tokens of a request are the nodes of its draft tree (node 0 = the newest real token,
parent(j) < j): each attends to the whole cached context and, among the step's tokens, to its ancestors and
itself. torch_ref is checked against SDPA with a mask built from the parents; triton against torch_ref. On CPU
the Triton kernels run under the interpreter (TRITON_INTERPRET=1, set below before anything imports Triton).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from attention_zoo.base import BackendCapabilities  # noqa: E402
from attention_zoo.registry import get_backend  # noqa: E402
from attention_zoo.triton_kernels import TileConfig  # noqa: E402
from tests.attention_zoo.paged_cases import PagedCase, make_case, run_backend  # noqa: E402

ON_CPU = not torch.cuda.is_available()
DEVICE = "cpu" if ON_CPU else "cuda"
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
BS = 16  # page size; the interpreter's key tile is 16 too

CHAIN = [-1, 0, 1, 2, 3]
BRANCHING = [-1, 0, 0, 1, 1, 2, 5, 3, 0, 8, 6, 6, 4, 12, 7, 7, 9, 16, 2, 18]  # 20 nodes: crosses key tiles
SINGLE = [-1]


def random_tree(num_nodes: int, seed: int) -> list[int]:
    """Parents of a random tree whose nodes are numbered so that parent(j) < j."""
    g = torch.Generator().manual_seed(seed)
    return [-1] + [int(torch.randint(0, j, (1,), generator=g)) for j in range(1, num_nodes)]


def ancestors_and_self(parents: list[int], node: int) -> list[int]:
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path


def tree_bits_of(parents: list[int]) -> list[int]:
    """Bit j of node t's mask is set iff j is t or one of its ancestors."""
    return [sum(1 << j for j in ancestors_and_self(parents, t)) for t in range(len(parents))]


def make_tree_case(
    trees: list[list[int]], context_lens: list[int], dtype: torch.dtype = torch.float32, pad_tokens: int = 0, **kw
) -> tuple[PagedCase, list[list[int]]]:
    """A verify step: request i's query tokens are the nodes of trees[i], after context_lens[i] cached tokens."""
    query_lens = [len(t) for t in trees]
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    shape = dict(num_heads=8, num_kv_heads=2, head_size=32, block_size=BS) | kw
    case = make_case(query_lens, seq_lens, dtype=dtype, pad_tokens=pad_tokens, device=DEVICE, **shape)
    bits = [b for tree in trees for b in tree_bits_of(tree)] + [0] * pad_tokens
    case.common.tree_bits = torch.tensor(bits, dtype=torch.int64, device=DEVICE)
    return case, trees


def sdpa_tree_reference(case: PagedCase, trees: list[list[int]]) -> torch.Tensor:
    """[num_real_tokens, num_heads, head_size] fp32: the cached context read slot by slot, the step's own K/V from
    case.k / case.v, and SDPA with a mask built from the parents (not from the bits)."""
    c = case.common
    k_flat = case.kv_cache[0].flatten(0, 1).float()
    v_flat = case.kv_cache[1].flatten(0, 1).float()
    outs = []
    for i, parents in enumerate(trees):
        start, q_len, seq_len = int(c.query_start_loc_cpu[i]), len(parents), int(c.seq_lens_cpu[i])
        ctx = seq_len - q_len
        ctx_slots = torch.tensor(
            [int(c.block_table[i, p // BS]) * BS + p % BS for p in range(ctx)], dtype=torch.long, device=DEVICE
        )
        k = torch.cat([k_flat[ctx_slots], case.k[start : start + q_len].float()])  # [seq_len, kv_heads, d]
        v = torch.cat([v_flat[ctx_slots], case.v[start : start + q_len].float()])
        mask = torch.zeros(q_len, seq_len, dtype=torch.bool, device=DEVICE)
        mask[:, :ctx] = True
        for t in range(q_len):
            mask[t, [ctx + a for a in ancestors_and_self(parents, t)]] = True
        q = case.q[start : start + q_len].float().transpose(0, 1)  # [heads, q_len, d]
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=case.spec.scale, enable_gqa=True
        )
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


def chain_bits(query_lens: list[int], pad_tokens: int, device) -> torch.Tensor:
    """[num_tokens] int64: token i of each request sees tokens 0..i of its request, like causal attention."""
    bits = [(1 << (i + 1)) - 1 for q in query_lens for i in range(q)] + [0] * pad_tokens
    return torch.tensor(bits, dtype=torch.int64, device=device)


@pytest.fixture(autouse=True, scope="module")
def _interpreter_or_cuda():
    if ON_CPU and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail("no CUDA and TRITON_INTERPRET is not 1: Triton kernels cannot run here")


# ---------------------------------------------------------------- tree masks


def test_backends_declare_token_trees():
    assert get_backend("torch_ref").capabilities.token_trees
    assert get_backend("triton").capabilities.token_trees
    assert not BackendCapabilities(devices=frozenset({"cpu"}), dtypes=frozenset({torch.float32})).token_trees


def test_torch_ref_matches_sdpa_with_an_ancestor_mask():
    """A chain, a branching tree, a single token and a 63-node tree (bit 62), each after a different context."""
    case, trees = make_tree_case([CHAIN, BRANCHING, SINGLE, random_tree(63, seed=1)], [13, 0, 40, 5], pad_tokens=2)
    out, _ = run_backend("torch_ref", case)
    n = case.num_real_tokens
    torch.testing.assert_close(out[:n], sdpa_tree_reference(case, trees), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "build_kwargs",
    [
        {},
        {"force_tile": TileConfig(block_q=3, tile_n=32)},  # a request's tree spans several query tiles
        {"force_num_splits": 2},  # split-KV never serves trees by choice; forced, it must still mask
    ],
    ids=["default", "block_q3", "split_kv"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_torch_ref(dtype, build_kwargs):
    case, _ = make_tree_case([BRANCHING, CHAIN, SINGLE], [BS + 3, 2 * BS, 7], dtype=dtype, pad_tokens=3)
    ref_out, ref_cache = run_backend("torch_ref", case)
    out, cache = run_backend("triton", case, **build_kwargs)
    n = case.num_real_tokens
    torch.testing.assert_close(cache, ref_cache, atol=0, rtol=0)
    torch.testing.assert_close(out[:n].float(), ref_out[:n].float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_triton_matches_torch_ref_on_a_63_node_tree():
    case, _ = make_tree_case([random_tree(63, seed=2), BRANCHING], [BS - 1, 3], num_heads=4)
    ref_out, _ = run_backend("torch_ref", case)
    out, _ = run_backend("triton", case)
    n = case.num_real_tokens
    torch.testing.assert_close(out[:n], ref_out[:n], atol=TOL[torch.float32], rtol=TOL[torch.float32])


@pytest.mark.parametrize("backend", ["torch_ref", "triton"])
def test_chain_bits_equal_causal_bit_for_bit(backend):
    query_lens, pad = [5, 1, 20], 2
    case = make_case(query_lens, [BS + 5, 9, 2 * BS + 20], num_heads=8, num_kv_heads=2, head_size=32, block_size=BS,
                     dtype=torch.float32, pad_tokens=pad, device=DEVICE)  # fmt: skip
    causal_out, causal_cache = run_backend(backend, case)
    case.common.tree_bits = chain_bits(query_lens, pad, DEVICE)
    tree_out, tree_cache = run_backend(backend, case)
    n = case.num_real_tokens
    torch.testing.assert_close(tree_cache, causal_cache, atol=0, rtol=0)
    torch.testing.assert_close(tree_out[:n], causal_out[:n], atol=0, rtol=0)


# ---------------------------------------------------------------- move_slots


def slot_cache(num_blocks: int = 4, block_size: int = 4) -> torch.Tensor:
    """[2, num_blocks, block_size, 2, 3] fp32 whose every entry names its K/V half and slot."""
    num_slots = num_blocks * block_size
    ids = torch.arange(2 * num_slots, dtype=torch.float32, device=DEVICE).view(2, num_blocks, block_size, 1, 1)
    return ids + torch.zeros(2, num_blocks, block_size, 2, 3, device=DEVICE)


def slot_tensor(slots: list[int]) -> torch.Tensor:  # [m] int64
    return torch.tensor(slots, dtype=torch.int64, device=DEVICE)


def expected_copy(cache: torch.Tensor, src: list[int], dst: list[int]) -> torch.Tensor:
    """The copy done one slot at a time from a snapshot of the cache."""
    before = cache.flatten(1, 2).clone()
    after = before.clone()
    for s, d in zip(src, dst):
        after[:, d] = before[:, s]
    return after.view_as(cache)


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        ([9, 14, 3], [4, 5, 6]),  # plain moves across blocks
        ([9, 10, 11, 12], [8, 9, 11, 10]),  # overlapping, shifted down, one copied onto itself
        ([5, 6], [6, 5]),  # a swap
        ([7, 7, 7, 2], [7, 7, 7, 3]),  # the compaction's skipped entries: the root onto itself, several times
        ([], []),
    ],
)
@pytest.mark.parametrize("backend", ["torch_ref", "triton"])
def test_move_slots(backend, src, dst):
    cache = slot_cache()
    want = expected_copy(cache, src, dst)
    get_backend(backend).move_slots(cache, slot_tensor(src), slot_tensor(dst))
    torch.testing.assert_close(cache, want, atol=0, rtol=0)


# ---------------------------------------------------------------- GPU: real shapes, bf16, CUDA graphs

needs_cuda = pytest.mark.skipif(ON_CPU, reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
def test_gpu_cuda_graph_replay_follows_new_tree_bits():
    """Captured once with tree_bits; replays after the bits (and q/k/v) change in place match torch_ref."""
    trees = [random_tree(16, seed=s) for s in range(8)]
    case, _ = make_tree_case(trees, [3000 + 17 * i for i in range(8)], dtype=torch.bfloat16, num_heads=32,
                             num_kv_heads=8, head_size=128)  # fmt: skip
    backend = get_backend("triton")
    impl = backend.make_impl(case.spec)
    metadata = backend.build_metadata(case.common)
    cache = case.kv_cache.clone()
    impl.forward(case.q, case.k, case.v, cache, metadata)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = impl.forward(case.q, case.k, case.v, cache, metadata)
    for seed in range(2):
        new_bits = [b for s in range(8) for b in tree_bits_of(random_tree(16, seed=100 + 8 * seed + s))]
        case.common.tree_bits.copy_(torch.tensor(new_bits, dtype=torch.int64))
        for t in (case.q, case.k, case.v):
            t.normal_()
        graph.replay()
        ref_out, _ = run_backend("torch_ref", case, kv_cache=cache)
        torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
