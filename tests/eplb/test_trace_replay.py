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


def test_replay_reports_vllms_metrics():
    from research_lm.eplb.metrics import CostModel

    trace = zipf_trace(30, 3, 32, alpha=1.2, drift=0.05, num_tokens=1024, seed=0)
    summary = replay(trace, "deepseek", 40, 1, 2, 8, step_interval=10, window_size=10, cost=CostModel()).summary()
    for key in ("balancedness_layer_min", "balancedness_layer_p50", "balancedness_layer_p90", "balancedness_layer_avg",
                "balancedness_step_min", "balancedness_step_p90", "num_rebalances", "rebalance_ms_median",
                "experts_moved_per_rebalance", "experts_moved_ib_per_rebalance", "bytes_moved_per_rebalance",
                "transfer_ms_per_rebalance", "slots_used", "step_ms", "ideal_step_ms", "stall_ms_total"):
        assert key in summary, key
    assert summary["balancedness_layer_min"] <= summary["balancedness_layer_p50"] <= summary["balancedness_layer_p90"]
    assert summary["bytes_moved_per_rebalance"] == summary["experts_moved_per_rebalance"] * CostModel().expert_bytes
    assert summary["step_ms"] > summary["ideal_step_ms"] > 0 and summary["slots_used"] <= 40


def test_replay_least_loaded_dispatch_never_trails_round_robin():
    trace = zipf_trace(40, 3, 32, alpha=1.2, drift=0.05, num_tokens=2048, seed=2)
    rr = replay(trace, "deepseek", 40, 1, 1, 8, step_interval=10, window_size=10)
    ll = replay(trace, "lplb", 40, 1, 1, 8, step_interval=10, window_size=10)
    assert ll.dispatch == "least_loaded" and rr.dispatch == "round_robin"
    assert rr.rebalance_steps == ll.rebalance_steps and rr.moved_slots == ll.moved_slots  # the same placements
    assert (ll.est_step_time <= rr.est_step_time + 1e-9).all() and ll.est_step_time.sum() < rr.est_step_time.sum()
    forced = replay(trace, "deepseek", 40, 1, 1, 8, step_interval=10, window_size=10, dispatch="least_loaded")
    assert torch.equal(forced.est_step_time, ll.est_step_time)
    with pytest.raises(ValueError, match="unknown dispatch rule"):
        replay(trace, "deepseek", 40, 1, 1, 8, step_interval=10, window_size=10, dispatch="random")


def test_replay_stalls_sync_for_the_whole_move_and_chunked_only_for_what_does_not_fit():
    from research_lm.eplb.metrics import CostModel

    trace = zipf_trace(40, 4, 32, alpha=1.2, drift=0.05, num_tokens=2048, seed=3)
    cost = CostModel(expert_tflops=1.0)  # slow experts: a long forward hides a chunk's transfer
    sync = replay(trace, "deepseek", 40, 1, 2, 8, step_interval=20, window_size=20, cost=cost)
    move_s = sync.moves[0]["transfer_ms"] / 1e3
    assert sync.stall_s.nonzero().flatten().tolist() == [20] and float(sync.stall_s[20]) == pytest.approx(move_s)
    chunked = replay(trace, "deepseek", 40, 1, 2, 8, step_interval=20, window_size=20, cost=cost, layers_per_chunk=1)
    assert float(chunked.stall_s.sum()) == 0.0  # every layer's transfer fits behind one forward
    # layer l switches after step 20 + l: until then it serves the old (identity) placement
    old = replay(trace, "none", 40, 1, 2, 8, step_interval=0, window_size=20)
    for layer in range(4):
        before, after = slice(20, 21 + layer), slice(21 + layer, None)
        assert torch.equal(chunked.balancedness_per_layer[before, layer], old.balancedness_per_layer[before, layer])
        assert torch.equal(chunked.balancedness_per_layer[after, layer], sync.balancedness_per_layer[after, layer])
    fast = CostModel(expert_tflops=1e9)  # no forward to hide behind: each step stalls for its chunk
    tight = replay(trace, "deepseek", 40, 1, 2, 8, step_interval=20, window_size=20, cost=fast, layers_per_chunk=2)
    assert float(tight.stall_s.sum()) == pytest.approx(move_s, rel=1e-3)  # the same move, spread over 2 steps
    assert float(tight.stall_s.max()) < move_s


def test_replay_gives_a_history_policy_its_buckets():
    from research_lm.eplb import registry

    seen = []

    @registry.register_policy("test_history", history_buckets=3)
    def history_policy(weight, num_replicas, num_groups, num_nodes, num_gpus):
        seen.append(torch.as_tensor(weight).clone())
        return get_policy("deepseek")(torch.as_tensor(weight).sum(0), num_replicas, num_groups, num_nodes, num_gpus)

    try:
        trace = zipf_trace(20, 2, 8, num_tokens=64, seed=0)
        replay(trace, "test_history", 8, 1, 1, 2, step_interval=10, window_size=7)
        assert len(seen) == 1 and seen[0].shape == (3, 2, 8)
        assert torch.equal(seen[0][0], trace[3:6].double().sum(0)) and torch.equal(seen[0].sum(0),
                                                                                   trace[3:10].double().sum(0))
    finally:
        registry.POLICIES.entries.pop("test_history")
