"""routing_stats on hand-made loads: the balanced and the one-expert extremes, values worked by hand, ties,
scale invariance, empty layers and steps."""

from __future__ import annotations

import math

import pytest
import torch

from research_lm.harness.train import routing_stats as rs


def test_balanced_and_one_expert_extremes():
    loads = torch.tensor([[5, 5, 5, 5], [0, 0, 12, 0]])  # [2 layers, 4 experts]
    assert rs.max_over_mean(loads).tolist() == pytest.approx([1.0, 4.0])
    assert rs.gini(loads).tolist() == pytest.approx([0.0, 3 / 4])
    assert rs.normalized_entropy(loads).tolist() == pytest.approx([1.0, 0.0], abs=1e-12)
    assert rs.top_share(loads).tolist() == pytest.approx([0.25, 1.0])
    assert rs.top_share(loads, k=2).tolist() == pytest.approx([0.5, 1.0])


def test_values_worked_by_hand():
    x = torch.tensor([1, 2, 3, 4])
    assert float(rs.max_over_mean(x)) == pytest.approx(4 / 2.5)
    # Gini as the mean absolute difference over all ordered pairs / (2 x mean): 20 / 16 / 5
    assert float(rs.gini(x)) == pytest.approx(0.25)
    p = [0.1, 0.2, 0.3, 0.4]
    assert float(rs.normalized_entropy(x)) == pytest.approx(-sum(v * math.log(v) for v in p) / math.log(4))
    assert float(rs.top_share(x)) == pytest.approx(0.4)


def test_drift_measures():
    a, b = torch.tensor([1, 2, 3, 4]), torch.tensor([2, 4, 6, 8])
    assert float(rs.l1_distance(a, b)) == pytest.approx(0.0)  # shares, not counts
    assert float(rs.spearman(a, b)) == pytest.approx(1.0)
    assert float(rs.l1_distance(torch.tensor([3, 0]), torch.tensor([0, 5]))) == pytest.approx(2.0)
    assert float(rs.spearman(a, a.flip(0))) == pytest.approx(-1.0)
    # ties share their average rank: ranks [1.5, 1.5, 3] vs [1, 2, 3] -> 1.5 / sqrt(1.5 * 2)
    assert float(rs.spearman(torch.tensor([1, 1, 2]), torch.tensor([1, 2, 3]))) == pytest.approx(1.5 / math.sqrt(3))
    assert float(rs.spearman(torch.tensor([2, 2, 2]), a[:3])) == 0.0  # a constant load has no order


def test_an_empty_layer_counts_as_balanced():
    zero = torch.zeros(4, dtype=torch.int64)
    assert float(rs.max_over_mean(zero)) == 1.0 and float(rs.gini(zero)) == pytest.approx(0.0)
    assert float(rs.normalized_entropy(zero)) == pytest.approx(1.0)


def test_skew_and_drift_of_a_trace():
    load = torch.tensor([  # [3 steps, 2 layers, 4 experts]
        [[4, 0, 0, 0], [1, 1, 1, 1]],
        [[0, 0, 0, 0], [1, 1, 1, 1]],  # layer 0 idle this step: not a step of that layer
        [[2, 2, 0, 0], [1, 1, 1, 1]],
    ])
    s = rs.skew(load)
    assert s["max_over_mean_per_layer"] == pytest.approx([6 / 8 * 4, 1.0])  # totals [6, 2, 0, 0] and uniform
    assert s["max_over_mean"] == pytest.approx((3.0 + 1.0) / 2)
    assert s["step_max_over_mean"] == pytest.approx((4.0 + 2.0 + 1.0 + 1.0 + 1.0) / 5)
    assert s["tokens_routed"] == 20
    first, second = rs.halves(load)
    assert first.shape[0] == 1 and second.shape[0] == 2
    d = rs.drift(first, second)  # layer 0: [1, 0, 0, 0] vs [.5, .5, 0, 0]; layer 1: identical
    assert d["l1_per_layer"] == pytest.approx([1.0, 0.0]) and d["l1"] == pytest.approx(0.5)
