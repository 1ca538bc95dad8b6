"""Balancedness (vLLM's definition), the simulated EP summary and the windowed load recorder."""

import pytest
import torch

from research_lm.eplb import (
    ExpertLoadWindow,
    balancedness,
    get_policy,
    physical_to_logical,
    rank_load,
    rebalance_experts,
    simulate_ep,
    slot_load,
)


def test_balancedness_per_layer_and_overall():
    ranks = torch.tensor([[1.0, 3.0], [2.0, 2.0], [0.0, 0.0]])
    per_layer, overall = balancedness(ranks)
    assert per_layer.tolist() == pytest.approx([2 / 3, 1.0, 1.0])  # an idle layer counts as balanced
    assert float(overall) == pytest.approx((2 + 2 + 0) / (3 + 2 + 0))  # Σ mean / Σ max, not mean of ratios


def test_replicated_expert_load_splits_evenly():
    weight = torch.tensor([[6.0, 2.0]])
    phy2log = torch.tensor([[0, 1, 0, 0]])
    logcnt = torch.tensor([[3, 1]])
    assert slot_load(weight, phy2log, logcnt).tolist() == [[2.0, 2.0, 2.0, 2.0]]
    assert rank_load(slot_load(weight, phy2log, logcnt), 2).tolist() == [[4.0, 4.0]]
    with pytest.raises(ValueError, match="divisible by num_ranks"):
        rank_load(torch.ones(1, 4), 3)


def test_simulate_ep_readme_example():
    weight = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                           [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
    phy2log, _, logcnt = rebalance_experts(weight, 16, 4, 2, 8)
    summary = simulate_ep(weight, phy2log, logcnt, num_ranks=8, num_nodes=2)
    assert summary.rank_load.shape == (2, 8) and summary.node_load.shape == (2, 2)
    assert torch.allclose(summary.rank_load.sum(-1), weight.sum(-1).double())  # load is conserved
    # layer 0, GPU 0 holds slots 0, 1 = expert 5 (165 / 2 replicas) and expert 6 (39)
    assert float(summary.rank_load[0, 0]) == pytest.approx(165 / 2 + 39)
    assert summary.est_step_time == pytest.approx(float(summary.rank_load.amax(-1).sum()))
    assert summary.balancedness == pytest.approx(summary.ideal_step_time / summary.est_step_time)
    none = get_policy("none")(weight, 16, 4, 2, 8)
    assert summary.balancedness > simulate_ep(weight, none[0], none[2], 8, 2).balancedness
    assert summary.to_dict()["max_replicas"] == 2


def test_physical_to_logical_inverts_slot_load():
    weight = torch.rand(3, 16, dtype=torch.float64) * 100
    phy2log, _, logcnt = rebalance_experts(weight, 24, 4, 2, 4)
    assert torch.allclose(physical_to_logical(slot_load(weight, phy2log, logcnt), phy2log, 16), weight)


def test_load_window_is_a_ring_buffer():
    window = ExpertLoadWindow(num_layers=2, num_physical=3, window=3)
    assert window.num_steps == 0 and window.windowed().sum() == 0
    for step in range(5):
        window.record(torch.full((2, 3), step))
    assert window.num_steps == 3 and window.num_recorded == 5
    assert torch.equal(window.windowed(), torch.full((2, 3), 2 + 3 + 4))
    window.reset()
    assert window.num_steps == 0 and window.windowed().sum() == 0
    with pytest.raises(ValueError, match="shape"):
        window.record(torch.zeros(3, 2))
    with pytest.raises(ValueError, match="window must be >= 1"):
        ExpertLoadWindow(1, 1, 0)


def test_load_window_feeds_a_policy():
    """Recorded physical counts -> logical load -> new placement, as the EPLB step will do it."""
    num_layers, num_logical, num_phy = 2, 8, 12
    phy2log, _, _ = get_policy("none")(torch.ones(num_layers, num_logical), num_phy, 1, 1, 4)
    window = ExpertLoadWindow(num_layers, num_phy, window=4)
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):
        window.record(torch.randint(0, 50, (num_layers, num_phy), generator=gen))
    logical = physical_to_logical(window.windowed(), phy2log, num_logical)
    assert logical.sum() == window.windowed().sum()
    new_phy2log, _, logcnt = rebalance_experts(logical, num_phy, 1, 1, 4)
    assert new_phy2log.shape == (num_layers, num_phy) and (logcnt.sum(-1) == num_phy).all()


def test_spread_stats_are_vllms_layer_summary():
    from research_lm.eplb.metrics import spread_stats

    stats = spread_stats(torch.tensor([0.5, 1.0, 0.75, 0.25, 1.0]), "b")
    assert stats == pytest.approx({"b_min": 0.25, "b_p50": 0.75, "b_p90": 1.0, "b_avg": 0.7})
    assert spread_stats(torch.zeros(0), "b")["b_min"] == 1.0  # nothing measured: nothing unbalanced


def test_migration_counts_transfers_per_link_and_skips_local_copies():
    """4 ranks of 2 slots on 2 nodes (ranks 0-1 node 0, 2-3 node 1). Old: rank r holds experts {2r, 2r + 1}."""
    from research_lm.eplb.metrics import CostModel, migration

    old = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7]])
    new = torch.tensor([[1, 0, 0, 3, 4, 5, 6, 2]])  # rank 0 swaps its slots (local), rank 1 gets 0 (NVLink from
    move = migration(old, new, num_ranks=4, num_nodes=2)  # rank 0), rank 3 gets 2 (InfiniBand from rank 1)
    assert move.moved_slots.tolist() == [4] and move.via_nvlink.tolist() == [1] and move.via_ib.tolist() == [1]
    assert move.nvlink_peak.tolist() == [1] and move.ib_peak.tolist() == [1]
    cost = CostModel(expert_bytes=1e9, nvlink_gbps=100, ib_gbps=10)
    assert move.layer_seconds(cost).tolist() == pytest.approx([0.01 + 0.1])
    summary = move.summary(cost)
    assert summary["experts_moved"] == 2 and summary["bytes_moved"] == 2e9
    assert summary["transfer_ms"] == pytest.approx(110.0)
    # the same expert arriving twice on one rank is one transfer; a busy sender sets the peak
    busy = migration(old, torch.tensor([[0, 1, 0, 0, 0, 0, 0, 0]]), 4, 2)
    assert busy.via_nvlink.tolist() == [1] and busy.via_ib.tolist() == [2] and busy.ib_peak.tolist() == [2]


def test_slots_used_counts_distinct_rank_expert_pairs():
    from research_lm.eplb.metrics import slots_used

    phy2log = torch.tensor([[0, 0, 1, 2], [0, 1, 0, 2]])  # layer 0: rank 0 holds expert 0 twice
    assert slots_used(phy2log, 2).tolist() == [3, 4]


def test_cost_model_defaults_are_deepseek_v3_fp8():
    from research_lm.eplb.metrics import CostModel

    cost = CostModel()
    assert cost.expert_bytes == 3 * 7168 * 2048 == 44_040_192  # fp8: one byte a weight
    assert cost.pair_seconds == pytest.approx(2 * 44_040_192 / 600e12)
    with pytest.raises(ValueError, match="CostModel.ib_gbps must be a positive number"):
        CostModel(ib_gbps=0)


def test_load_window_history_is_chronological_buckets():
    from research_lm.eplb.load import bucket_history

    window = ExpertLoadWindow(num_layers=1, num_physical=1, window=4)
    for step in range(6):  # the window keeps steps 2, 3, 4, 5
        window.record(torch.full((1, 1), step))
    assert window.history(2).flatten().tolist() == [2 + 3, 4 + 5]
    assert window.history(10).flatten().tolist() == [2, 3, 4, 5]
    assert bucket_history(torch.arange(5)[:, None], 2).flatten().tolist() == [0 + 1 + 2, 3 + 4]
    assert ExpertLoadWindow(1, 2, 3).history(4).shape == (1, 1, 2)  # nothing recorded: one bucket of zeros
