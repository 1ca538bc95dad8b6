"""Dispatch among replicas (research_lm.eplb.dispatch): water-filling is the min-max pour, least-loaded dispatch
conserves every token, never leaves a rank above round robin's max, and gives a same-rank copy nothing."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from research_lm.eplb import get_policy, rank_load, slot_load, zipf_trace
from research_lm.eplb.dispatch import least_loaded, replica_ranks, waterfill

INF = float("inf")


def test_waterfill_raises_the_lowest_bins_to_one_level():
    fill = waterfill(torch.tensor([5.0, 0.0, 9.0, 1.0]),
                     torch.tensor([[1.0, 3.0, INF], [1.0, 2.0, 3.0], [0.0, 0.0, 0.0], [4.0, 1.0, 1.0]]))
    assert fill.tolist() == [[3.5, 1.5, 0.0], [0.0, 0.0, 0.0], [3.0, 3.0, 3.0], [0.0, 0.5, 0.5]]


@settings(max_examples=60, deadline=None)
@given(levels=st.lists(st.floats(0, 100), min_size=1, max_size=5), amount=st.floats(0, 300))
def test_waterfill_is_the_min_max_pour(levels, amount):
    """Conserves the amount and reaches the least possible highest bin, max(h, highest level), where the level h
    solves Σ max(0, h - level) = amount (found by bisection)."""
    lv = torch.tensor(levels, dtype=torch.float64)
    fill = waterfill(torch.tensor(amount, dtype=torch.float64), lv)
    assert (fill >= 0).all() and float(fill.sum()) == pytest.approx(amount, abs=1e-9)
    lo, hi = float(lv.min()), float(lv.max()) + amount
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if float((mid - lv).clamp_min(0).sum()) < amount else (lo, mid)
    assert float((lv + fill).max()) == pytest.approx(max(hi, float(lv.max())), abs=1e-6)


def test_replica_ranks_drop_a_second_copy_on_one_rank():
    log2phy = torch.tensor([[[0, 1, 4, -1], [2, -1, -1, -1], [3, 5, -1, -1]]])  # 2 slots a rank
    assert replica_ranks(log2phy, 2).tolist() == [[[0, -1, 2, -1], [1, -1, -1, -1], [1, 2, -1, -1]]]


def test_least_loaded_splits_one_replicated_expert_optimally():
    """Expert 0 (12 tokens) on ranks 0 and 1; rank 0 already has 6 of expert 1: the split is 3 | 9."""
    log2phy = torch.tensor([[[0, 2], [1, -1], [3, -1]]])  # slots: rank 0 {0, 1}, rank 1 {2, 3}
    counts = torch.tensor([[[12.0, 6.0, 0.0]]])
    ranks, alloc = least_loaded(counts, log2phy, 2, 2, return_alloc=True)
    assert ranks.tolist() == [[[9.0, 9.0]]] and alloc[0, 0, 0].tolist() == [3.0, 9.0]
    even = rank_load(slot_load(counts, torch.tensor([[0, 1, 0, 2]]), torch.tensor([[2, 1, 1]])), 2)
    assert even.tolist() == [[[12.0, 6.0]]]


@pytest.mark.parametrize("policy", ["none", "deepseek", "deepseek_vec", "budgeted"])
def test_least_loaded_conserves_tokens_and_never_exceeds_round_robin(policy):
    num_layers, num_experts, num_slots, num_ranks = 3, 32, 40, 8
    trace = zipf_trace(12, num_layers, num_experts, alpha=1.2, drift=0.1, num_tokens=512, seed=1).double()
    phy2log, log2phy, logcnt = get_policy(policy)(trace.sum(0), num_slots, 1, 1, num_ranks)
    rr = rank_load(slot_load(trace, phy2log, logcnt), num_ranks)
    ll, alloc = least_loaded(trace, log2phy, num_ranks, num_slots // num_ranks, return_alloc=True)
    assert torch.allclose(ll.sum(-1), trace.sum(-1)) and torch.allclose(alloc.sum(-1), trace)
    assert (ll.amax(-1) <= rr.amax(-1) + 1e-9).all()
    if policy == "deepseek":
        assert ll.amax(-1).sum() < rr.amax(-1).sum()  # per-batch balancing finds something on this trace
    # a second copy on a rank gets no share of its own; the first replica on each rank carries it
    dup = replica_ranks(log2phy, num_slots // num_ranks) < 0
    assert (alloc[:, dup & (log2phy >= 0)] == 0).all()


def test_least_loaded_matches_brute_force_on_small_batches():
    """Two replicated experts sharing a rank: the sweeps reach the best integer split's max within a token."""
    log2phy = torch.tensor([[[0, 2, -1], [1, 4, -1], [3, -1, -1], [5, -1, -1]]])  # rank r: slots 2r, 2r + 1
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        counts = torch.randint(0, 12, (1, 1, 4), generator=gen).double()
        ranks, _ = least_loaded(counts, log2phy, 3, 2)
        c0, c1, c2, c3 = counts.flatten().tolist()
        # rank 0: a of e0 + b of e1; rank 1: the rest of e0 + e2; rank 2: the rest of e1 + e3
        best = min(max(a + b, c0 - a + c2, c1 - b + c3)
                   for a, b in itertools.product(range(int(c0) + 1), range(int(c1) + 1)))
        assert float(ranks.amax()) <= best + 1.0
