"""The shipped traces of the trained MoEs load with research_lm.eplb.trace, have the model's shape, tile into the
switch trace, and hold a trained router's skew and drift; experiments/moe_routing_skew.py runs end to end."""

from __future__ import annotations

import json

import pytest
import torch

import experiments.paper as paper
from research_lm.eplb.trace import load_trace
from research_lm.harness.train import routing_stats as rs
from research_lm.harness.train.moe_traces import SHIPPED_TRACES, TRACE_KINDS, shipped_trace

VARIANTS = ("qwen2_moe", "qwen3_moe")


@pytest.mark.parametrize("variant", VARIANTS)
def test_shipped_traces_load_with_their_shape_and_provenance(variant):
    traces = {kind: load_trace(shipped_trace(variant, kind)) for kind in TRACE_KINDS}
    for trace in traces.values():
        assert trace.load.dim() == 3 and trace.load.shape[1:] == (4, 16) and not trace.load.is_floating_point()
        assert trace.meta["top_k"] == 2 and trace.meta["policy"] == "none"
        checkpoint = trace.meta["checkpoint"]
        assert checkpoint["variant"] == variant and checkpoint["weights"] == "trained"
        assert checkpoint["corpus_hash"] and checkpoint["router_aux_loss_coef"] == 0.001
        per_layer = trace.load.sum(-1)  # every layer routes each step's tokens top_k times
        assert (per_layer == per_layer[:, :1]).all() and (per_layer % 2 == 0).all()
    code, prose, switch = (traces[k] for k in TRACE_KINDS)
    assert torch.equal(switch.load, torch.cat([code.load, prose.load]))
    segments = switch.meta["segments"]
    assert [(s["kind"], s["start"], s["stop"]) for s in segments] == [
        ("code", 0, code.num_steps), ("prose", code.num_steps, switch.num_steps)]


@pytest.mark.parametrize("variant", VARIANTS)
def test_shipped_traces_are_skewed_and_drift_between_workloads(variant):
    """A trained router: far from balanced on both workloads, and code vs prose moves the load several times
    more than the two halves of one workload differ."""
    code, prose = (load_trace(shipped_trace(variant, k)).load for k in ("code", "prose"))
    for load in (code, prose):
        assert rs.skew(load)["max_over_mean"] > 2.0
    same = (rs.drift(*rs.halves(code))["l1"] + rs.drift(*rs.halves(prose))["l1"]) / 2
    assert rs.drift(code, prose)["l1"] > 3 * same


def test_shipped_trace_names_its_choices():
    with pytest.raises(ValueError, match=r"no shipped MoE trace variant 'mixtral'.*qwen3_moe"):
        shipped_trace("mixtral")
    with pytest.raises(ValueError, match=r"unknown trace kind 'chat'.*switch"):
        shipped_trace("qwen3_moe", "chat")
    assert sorted(p.name for p in SHIPPED_TRACES.iterdir() if p.is_dir()) == list(VARIANTS)


def test_the_table_script_runs_end_to_end(tmp_path):
    """Two training steps, two requests per workload: rows for init and trained, the table, the traces."""
    bench = paper.import_bench("moe_routing_skew")
    payload = bench.main(["--variants", "qwen3_moe", "--steps", "2", "--requests", "2", "--max-tokens", "3",
                          "--corpus-bytes", "30000", "--repeats", "1", "--no-plot", "--out", str(tmp_path / "out"),
                          "--traces-out", str(tmp_path / "traces"), "--work-dir", str(tmp_path / "work"),
                          "--cache-dir", str(tmp_path / "cache")])
    rows = {(r["variant"], r["weights"]): r for r in payload["rows"]}
    assert sorted(rows) == [("qwen3_moe", "init"), ("qwen3_moe", "trained")]
    trained = rows["qwen3_moe", "trained"]
    assert trained["code_max_over_mean"] >= 1.0 and 0.0 <= trained["drift_l1"] <= 2.0 and "val_lm_loss" in trained
    assert len(trained["code_shares"]) == 4 and sum(trained["code_shares"][0]) == pytest.approx(1.0)
    table = (tmp_path / "out" / "moe_routing_skew.md").read_text()
    assert "| qwen3_moe | trained |" in table and "L1 code vs prose" in table
    assert json.loads((tmp_path / "out" / "moe_routing_skew.json").read_text())["setup"]["steps"] == 2
    switch = load_trace(tmp_path / "traces" / "qwen3_moe" / "switch.npz")
    assert switch.meta["checkpoint"]["steps"] == 2 and switch.load.shape[1:] == (4, 16)
