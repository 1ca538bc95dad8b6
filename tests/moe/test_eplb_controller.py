"""EPLB through the engine: rebalancing moves weights but not tokens, per-step loads count every routed
pair, simulated-EP metrics add up, and a recorded trace replays offline to the same rebalances."""

from __future__ import annotations

import random

import pytest
import torch

from research_lm import LLM, SamplingParams
from research_lm.eplb import get_policy, load_trace, replay
from research_lm.eplb.controller import build_eplb_controller
from research_lm.moe import FusedMoE

PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
EPLB = dict(policy="deepseek", step_interval=2, window_size=3, num_redundant_experts=2, num_ep_ranks=2)


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for n in (4, 9, 15, 22, 31)]


def _llm(path, eplb=None) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16,
               max_num_seqs=4, max_model_len=64, eplb_config=eplb)


def _generate(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(), PARAMS, use_tqdm=False)]


@pytest.mark.parametrize("name", ["mixtral", "qwen2-moe"])
def test_rebalancing_moves_weights_not_tokens(name, tiny_checkpoint):
    baseline = _generate(_llm(tiny_checkpoint(name)))
    llm = _llm(tiny_checkpoint(name), EPLB)
    layers = [m for m in llm.engine.model.modules() if isinstance(m, FusedMoE)]
    initial = [layer.phy2log.clone() for layer in layers]
    assert _generate(llm) == baseline
    ctrl = llm.engine.eplb
    assert ctrl.num_rebalances >= 3 and sum(ctrl.moved_slots) > 0
    assert any(not torch.equal(layer.phy2log, p) for layer, p in zip(layers, initial))
    for layer in layers:  # every slot holds a copy of the expert its map names
        replicas = [layer.log2phy[e, : layer.logcnt[e]].tolist() for e in range(layer.num_experts)]
        for slots in replicas:
            for s in slots[1:]:
                assert torch.equal(layer.gate_up_proj[s], layer.gate_up_proj[slots[0]])
        assert sorted(s for slots in replicas for s in slots) == list(range(layer.num_slots))


def test_step_loads_count_tokens_times_top_k(tiny_checkpoint, tmp_path):
    llm = _llm(tiny_checkpoint("qwen3-moe"), {**EPLB, "record_trace": str(tmp_path / "t.npz")})
    tokens_per_step = []
    launch = llm.engine.runner.launch

    def counting_launch(sched):
        tokens_per_step.append(sum(s.num_new_tokens for s in sched.scheduled))
        return launch(sched)

    llm.engine.runner.launch = counting_launch
    _generate(llm)
    ctrl = llm.engine.eplb
    top_k = llm.engine.hf_config.num_experts_per_tok
    steps = torch.stack(ctrl.recorder.steps)  # [steps, L, E] logical load
    assert steps.shape[0] == len(tokens_per_step) == ctrl.num_steps
    expected = torch.tensor(tokens_per_step)[:, None].expand(-1, steps.shape[1]) * top_k
    assert torch.equal(steps.sum(-1), expected)
    summary = ctrl.summary()
    assert summary["tokens_routed"] == sum(tokens_per_step) * top_k * steps.shape[1]
    assert sum(summary["rank_load"]) == summary["tokens_routed"]
    assert 0.5 <= summary["balancedness_total"] <= 1.0  # 2 ranks: at worst everything on one
    assert summary["est_step_time"] >= summary["ideal_step_time"] > 0
    assert summary["max_replicas"] >= 2 and summary["num_physical_experts"] == 10


@pytest.mark.parametrize("max_rebalances", [None, 1])
def test_recorded_trace_replays_to_the_same_rebalances(max_rebalances, tiny_checkpoint, tmp_path):
    path = tmp_path / "trace.npz"
    llm = _llm(tiny_checkpoint("mixtral"), {**EPLB, "record_trace": str(path), "max_rebalances": max_rebalances})
    _generate(llm)
    ctrl = llm.engine.eplb
    summary = ctrl.summary()  # writes the trace
    assert summary["trace_path"] == str(path)
    trace = load_trace(path)
    assert trace.num_steps == ctrl.num_steps and trace.meta["policy"] == "deepseek"
    assert trace.meta["model"] == "MixtralForCausalLM" and trace.meta["top_k"] == 2
    result = replay(trace.load, "deepseek", num_replicas=10, num_groups=1, num_nodes=1, num_gpus=2,
                    step_interval=2, window_size=3, max_rebalances=max_rebalances)
    # replay skips a rebalance after the trace's last step (nothing follows it); the engine cannot know
    served = [i for i, s in enumerate(ctrl.rebalance_steps) if s < ctrl.num_steps - 1]
    assert result.rebalance_steps == [ctrl.rebalance_steps[i] for i in served]
    assert result.moved_slots == [ctrl.moved_slots[i] for i in served]
    assert summary["num_rebalances"] == (1 if max_rebalances else ctrl.num_steps // 2)


def test_controller_is_built_only_when_needed(tiny_checkpoint, tmp_path):
    dense = _llm(tiny_checkpoint("llama"), EPLB)
    assert dense.engine.eplb is None
    moe = _llm(tiny_checkpoint("qwen3-moe"))
    assert moe.engine.eplb is None
    model = moe.engine.model
    assert build_eplb_controller(model, {"policy": "none"}) is None  # identity, never rebalanced, 1 rank
    assert build_eplb_controller(model, {"record_trace": str(tmp_path / "t.npz")}) is not None
    with pytest.raises(ValueError, match="redundant experts"):
        build_eplb_controller(model, {"num_ep_ranks": 2, "num_redundant_experts": 2})  # built with 0
    with pytest.raises(ValueError, match="unknown eplb config key"):
        build_eplb_controller(model, {"polcy": "lpt"})
    with pytest.raises(ValueError, match="unknown EPLB policy"):
        build_eplb_controller(model, {"policy": "magic"})


def test_baseline_none_reports_simulated_ep(tiny_checkpoint):
    """`none` with several ranks keeps identity placement and still measures balance."""
    llm = _llm(tiny_checkpoint("qwen3-moe"), dict(policy="none", num_ep_ranks=4, num_redundant_experts=0))
    _generate(llm)
    summary = llm.engine.eplb.summary()
    assert summary["num_rebalances"] == 0 and summary["moved_slots_total"] == 0
    assert 0.25 <= summary["balancedness_total"] <= 1.0 and len(summary["rank_load"]) == 4


def test_history_policy_least_loaded_dispatch_and_chunked_moves_replay_alike(tiny_checkpoint, tmp_path):
    """deepseek_vec (the window's history), least-loaded dispatch and one layer moved a step: the tokens do not
    change, each rebalance's layers move after the next steps (one each, never all in one), and replaying the
    recorded trace with the same settings gives the same rebalances and moves."""
    path = tmp_path / "trace.npz"
    eplb = {**EPLB, "policy": "deepseek_vec", "dispatch": "least_loaded", "rebalance_layers_per_chunk": 1,
            "record_trace": str(path), "step_interval": 3}
    baseline = _generate(_llm(tiny_checkpoint("mixtral")))
    llm = _llm(tiny_checkpoint("mixtral"), eplb)
    assert _generate(llm) == baseline
    ctrl = llm.engine.eplb
    assert all(layer.dispatch == "least_loaded" for layer in ctrl.layers) and len(ctrl.layers) == 2
    summary = ctrl.summary()
    assert summary["num_rebalances"] >= 3 and summary["dispatch"] == "least_loaded"
    for step in ctrl.rebalance_steps:  # chunk k moves after step + 1 + k
        assert step not in ctrl.stall_ms
        assert all(s in ctrl.stall_ms for s in (step + 1, step + 2) if s < ctrl.num_steps)
    for key in ("balancedness_layer_min", "balancedness_layer_p90", "balancedness_step_p50", "stall_ms_max",
                "experts_moved_per_rebalance", "bytes_moved_per_rebalance", "transfer_ms_per_rebalance", "slots_used"):
        assert key in summary, key
    assert summary["expert_bytes"] == ctrl.layers[0].slot_bytes()
    result = replay(load_trace(path).load, "deepseek_vec", num_replicas=10, num_groups=1, num_nodes=1, num_gpus=2,
                    step_interval=3, window_size=3, dispatch="least_loaded", layers_per_chunk=1)
    served = [i for i, s in enumerate(ctrl.rebalance_steps) if s < ctrl.num_steps - 1]
    assert result.rebalance_steps == [ctrl.rebalance_steps[i] for i in served]
    assert result.moved_slots == [ctrl.moved_slots[i] for i in served]
    assert [m["experts_moved"] for m in result.moves] == [ctrl.moves[i]["experts_moved"] for i in served]


def test_least_loaded_slots_follow_the_batch(tiny_checkpoint):
    """A layer's least-loaded slots: every pair lands on a replica of its expert, and the simulated ranks end no
    more loaded than round robin's."""
    from research_lm.eplb import rank_load

    llm = _llm(tiny_checkpoint("mixtral"), {**EPLB, "policy": "lplb", "num_redundant_experts": 4, "step_interval": 0})
    layer = llm.engine.eplb.layers[0]
    weight = torch.tensor([[40.0, 30.0, 5, 5, 5, 5, 5, 5]])
    layer.apply_placement(*(t[0] for t in get_policy("deepseek")(weight, 12, 1, 1, 2)))
    gen = torch.Generator().manual_seed(0)
    ids = torch.multinomial(weight[0], 2 * 60, replacement=True, generator=gen).view(60, 2)
    slots = layer.to_physical(ids)
    assert torch.equal(layer.phy2log[slots], ids)
    layer.dispatch = "round_robin"
    rr = layer.to_physical(ids)
    loads = [rank_load(torch.bincount(s.flatten(), minlength=12).double(), 2).max() for s in (slots, rr)]
    assert loads[0] <= loads[1]
