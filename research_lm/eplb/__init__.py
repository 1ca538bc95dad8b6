"""Expert-parallel load balancing (EPLB): placement policies, load recording, metrics, trace replay.

    from research_lm.eplb import rebalance_experts, get_policy
    phy2log, log2phy, logcnt = rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)
    phy2log, log2phy, logcnt = get_policy("lpt")(weight, num_replicas, num_groups, num_nodes, num_gpus)

Policies (`available_policies()`): none, deepseek, deepseek_swap, lpt, snake; see each module's
docstring for the question it answers. The registry's contract is in `research_lm.eplb.registry`.
The engine's side: `settings.EplbSettings` (an eplb_config, validated) and `controller.build_eplb_controller`
(record load, rebalance every step_interval steps, simulate EP), imported from their modules.
"""

from research_lm.eplb.deepseek import rebalance_experts
from research_lm.eplb.load import ExpertLoadWindow, physical_to_logical
from research_lm.eplb.metrics import EPSummary, balancedness, rank_load, simulate_ep, slot_load
from research_lm.eplb.registry import available_policies, get_policy, register_policy
from research_lm.eplb.replay import ReplayResult, replay
from research_lm.eplb.synthetic import zipf_load, zipf_trace
from research_lm.eplb.trace import ExpertTrace, TraceRecorder, load_trace, save_trace

__all__ = [
    "EPSummary", "ExpertLoadWindow", "ExpertTrace", "ReplayResult", "TraceRecorder",
    "available_policies", "balancedness", "get_policy", "load_trace", "physical_to_logical",
    "rank_load", "rebalance_experts", "register_policy", "replay", "save_trace", "simulate_ep",
    "slot_load", "zipf_load", "zipf_trace",
]
