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
