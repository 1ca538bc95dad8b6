"""Trace files (save, load, record) and offline replay of policies over a trace."""

import numpy as np
import pytest
import torch
import yaml

from research_lm.eplb import (
    TraceRecorder,
    available_policies,
    get_policy,
    load_trace,
    replay,
    save_trace,
    simulate_ep,
    zipf_load,
    zipf_trace,
)


def test_trace_round_trip(tmp_path):
    load = torch.randint(0, 100, (5, 2, 8))
    path = tmp_path / "trace.npz"
    save_trace(path, load, {"model": "tiny-moe", "top_k": 2})
    trace = load_trace(path)
    assert torch.equal(trace.load, load) and trace.meta == {"model": "tiny-moe", "top_k": 2}
    assert trace.num_steps == 5


def test_trace_recorder(tmp_path):
    rec = TraceRecorder(num_layers=2, num_logical=4)
    for step in range(3):
        rec.record(torch.full((2, 4), step))
    rec.save(tmp_path / "t.npz", meta={"source": "test"})
    trace = load_trace(tmp_path / "t.npz")
    assert trace.load.shape == (3, 2, 4) and trace.load[2].unique().tolist() == [2]
    with pytest.raises(ValueError, match="shape"):
        rec.record(torch.zeros(4, 2))


def test_load_trace_rejects_other_files(tmp_path):
    np.savez(tmp_path / "other.npz", load=np.zeros((1, 1, 1)))
    with pytest.raises(ValueError, match="not an expert-load trace"):
        load_trace(tmp_path / "other.npz")
    with pytest.raises(ValueError, match="num_steps, num_layers, num_logical"):
        save_trace(tmp_path / "bad.npz", np.zeros((2, 3)))


def test_synthetic_loads_are_seeded_and_skewed():
    a, b = zipf_load(4, 64, alpha=1.2, seed=3), zipf_load(4, 64, alpha=1.2, seed=3)
    assert torch.equal(a, b) and a.shape == (4, 64)
    flat = zipf_load(4, 64, alpha=0.0, seed=3).double()
    assert (a.double().amax(-1) / a.double().mean(-1)).min() > 2 * (flat.amax(-1) / flat.mean(-1)).max()
    trace = zipf_trace(10, 3, 16, seed=1)
    assert trace.shape == (10, 3, 16) and torch.equal(trace, zipf_trace(10, 3, 16, seed=1))


def test_inclusion_probs_cap_each_expert_at_every_token():
    from research_lm.eplb.synthetic import inclusion_probs
    probs = torch.arange(1, 65, dtype=torch.float64) ** -1.5
    probs = torch.stack([probs / probs.sum(), torch.full((64,), 1 / 64, dtype=torch.float64)])
    share = inclusion_probs(probs, 8)
    assert torch.allclose(share.sum(-1), torch.full((2,), 8.0, dtype=torch.float64))
    assert share.max() <= 1.0 and share[0, 0] == 1.0 and (share[0].diff() <= 1e-12).all()
    assert torch.allclose(share[1], torch.full((64,), 8 / 64, dtype=torch.float64))
    assert zipf_load(2, 64, alpha=2.0, num_tokens=1000, top_k=8).max() < 1150  # ~1000 tokens at most


def test_replay_without_rebalancing_is_the_identity():
    trace = zipf_trace(12, 2, 16, num_tokens=512, seed=0)
    result = replay(trace, "deepseek", 20, 4, 2, 4, step_interval=0, window_size=4)
    assert result.rebalance_steps == [] and result.balancedness.shape == (12,)
    none = get_policy("none")(trace[0], 20, 4, 2, 4)
    for t in (0, 11):
        assert float(result.balancedness[t]) == pytest.approx(
            simulate_ep(trace[t], none[0], none[2], 4, 2).balancedness)


def test_replay_rebalances_on_schedule_and_helps():
    trace = zipf_trace(40, 3, 32, alpha=1.2, drift=0.02, num_tokens=2048, seed=0)
    base = replay(trace, "none", 40, 4, 2, 8, step_interval=10, window_size=5)
    result = replay(trace, "deepseek", 40, 4, 2, 8, step_interval=10, window_size=5)
    assert result.rebalance_steps == [9, 19, 29]
    assert len(result.rebalance_ms) == len(result.moved_slots) == 3
    assert result.balancedness_per_layer.shape == (40, 3)
    # after the first rebalance deepseek beats the identity at every step
    assert (result.balancedness[10:] > base.balancedness[10:]).all()
    static = replay(trace, "deepseek", 40, 4, 2, 8, step_interval=10, window_size=10, max_rebalances=1)
    assert static.rebalance_steps == [9]
    summary = result.summary()
    assert summary["num_rebalances"] == 3 and 0 < summary["balancedness_total"] <= 1


@pytest.mark.parametrize("path", sorted(__import__("pathlib").Path(__file__).parents[2].glob("conf/eplb/*.yaml")))
def test_eplb_configs_name_a_registered_policy(path):
    cfg = yaml.safe_load(path.read_text())
    assert set(cfg) >= {"policy", "step_interval", "window_size", "num_ep_ranks", "num_nodes",
                        "num_redundant_experts"}
    assert cfg["policy"] in available_policies()
