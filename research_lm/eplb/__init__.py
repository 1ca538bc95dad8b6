"""Expert-parallel load balancing (EPLB): placement policies, load recording, metrics, trace replay.

    from research_lm.eplb import rebalance_experts, get_policy
    phy2log, log2phy, logcnt = rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)
    phy2log, log2phy, logcnt = get_policy("lpt")(weight, num_replicas, num_groups, num_nodes, num_gpus)

Policies (`available_policies()`): none, deepseek, deepseek_swap, lpt, snake, deepseek_vec (the load history),
budgeted (replicas under a slot budget), lplb (least-loaded dispatch); see each module's docstring for the question
it answers. The registry's contract, and the traits a policy may declare (history, dispatch), are in
`research_lm.eplb.registry`; dispatch among replicas in `dispatch`; vLLM's metrics, what a rebalance moves and
the `CostModel` in `metrics`. The engine's side: `settings.EplbSettings` (an eplb_config, validated) and
`controller.build_eplb_controller` (record load, rebalance every step_interval steps, simulate EP), imported from
their modules.
"""

from research_lm.eplb.deepseek import rebalance_experts
from research_lm.eplb.load import ExpertLoadWindow, physical_to_logical
from research_lm.eplb.metrics import (
    CostModel,
    EPSummary,
    Migration,
    balancedness,
    migration,
    rank_load,
    simulate_ep,
    slot_load,
    slots_used,
)
from research_lm.eplb.registry import available_policies, configured_policy, get_policy, policy_traits, register_policy
from research_lm.eplb.replay import ReplayResult, replay
from research_lm.eplb.synthetic import mixture_trace, zipf_load, zipf_trace
from research_lm.eplb.trace import ExpertTrace, TraceRecorder, load_trace, save_trace

__all__ = [
    "CostModel", "EPSummary", "ExpertLoadWindow", "ExpertTrace", "Migration", "ReplayResult", "TraceRecorder",
    "available_policies", "balancedness", "configured_policy", "get_policy", "load_trace", "migration",
    "mixture_trace", "physical_to_logical", "policy_traits", "rank_load", "rebalance_experts", "register_policy",
    "replay", "save_trace", "simulate_ep", "slot_load", "slots_used", "zipf_load", "zipf_trace",
]
