"""The MoE block: router, routed experts on physical slots (EPLB placement), optional shared expert.

    MoeBlock                     the model's `mlp`; checkpoint names under it:
      gate: MoeGate              gate.weight [E, H], gate.e_score_correction_bias [E] (DeepSeek-V3)
      experts: FusedMoE          experts.{e}.{gate,up,down}_proj.weight, or fused experts.gate_up_proj
      shared_expert: GatedMLP    shared_expert.{gate,up,down}_proj.weight (Qwen2-MoE; DeepSeek's
      shared_expert_gate         shared_experts.* map here), shared_expert_gate.weight [1, H]

DeepSeek-V2/V3 plug in with RouterConfig(scoring_func=..., num_expert_group=n_group, topk_group=...,
routed_scaling_factor=..., has_correction_bias=V3, logits_fp32=True), shared_intermediate_size =
moe_intermediate_size * n_shared_experts, no shared gate, and `load_moe_params(...,
renames=((".shared_experts.", ".shared_expert."),))`; tests/moe/test_moe_layer.py checks this block
against transformers' DeepseekV2Moe / DeepseekV3MoE.

Placement. `FusedMoE` holds P = E + num_redundant_experts physical slots; slot s holds a copy of logical
expert phy2log[s], and logical expert e has logcnt[e] replicas at log2phy[e, :logcnt[e]]. Which replica a
token routed to e uses is the EPLB dispatch rule (`eplb.dispatch`, or the policy's): `round_robin`, replica
t % logcnt[e] (t = its index in the batch), or `least_loaded`, the batch's tokens of e split among its
replicas' ranks so as to balance the ranks (research_lm.eplb.dispatch; with layer EP the per-expert counts
are all-reduced first, `ep.global_expert_counts`). A rebalance (`apply_placement`) copies weights between
slots in place and rewrites the maps; since replicas are exact copies and each (token, expert) pair is
computed on its own row, outputs do not change.

Load. With `record_load` on, every forward adds the tokens routed to each slot into `expert_load`
[P] int64 on the device (a scatter-add: no host sync); the EPLB controller reads and zeroes it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from research_lm.eplb import get_policy
from research_lm.eplb.dispatch import least_loaded
from research_lm.models.base import default_weight_loader, set_weight_loader
from research_lm.models.layers import GatedMLP, Linear
from research_lm.moe.config import MoeOptions
from research_lm.moe.ep import (
    dispatch_combine,
    dispatch_combine_replicated,
    global_expert_counts,
    move_expert_weights,
    transfer_plan,
)
from research_lm.moe.experts import fused_experts
from research_lm.moe.router import RouterConfig, route


class MoeGate(nn.Module):
    """Router logits = x W^T (fp32 when the config says so), then `route`."""

    def __init__(self, hidden_size: int, num_experts: int, config: RouterConfig):
        super().__init__()
        config.validate(num_experts)
        self.config = config
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        set_weight_loader(self.weight, default_weight_loader)
        if config.has_correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts))
            set_weight_loader(self.e_score_correction_bias, default_weight_loader)
        else:
            self.register_parameter("e_score_correction_bias", None)

    def forward(
        self, hidden: torch.Tensor  # [T, H]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, k] fp32, logical ids [T, k] int64
        if self.config.logits_fp32:
            logits = F.linear(hidden.float(), self.weight.float())
        else:
            logits = F.linear(hidden, self.weight)
        return route(logits, self.config, self.e_score_correction_bias)


class FusedMoE(nn.Module):
    """Routed experts on physical slots. Parameters use transformers 5's stacked layout over slots:
    gate_up_proj [P, 2I, H] (gate rows, then up rows) and down_proj [P, H, I]; with an expert-parallel
    group of R ranks (`options.ep_group`), only this rank's P / R slots, and forward dispatches pairs to
    the ranks holding their slots (`research_lm.moe.ep`): each rank's own tokens, or, with
    `options.ep_replicated_tokens` (engine EP: the same tokens on every rank), each rank's shard of them."""

    cuda_graphs = False  # routing reads expert counts on the host (bincount().tolist()): no capture

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, options: MoeOptions,
        num_groups: int = 1,  # expert groups of group-limited routing, for the placement policy
    ):
        super().__init__()
        options.eplb.check_experts(num_experts)
        self.num_experts = num_experts  # logical
        self.num_slots = num_experts + options.num_redundant_experts  # physical
        self.num_groups = num_groups
        self.intermediate_size = intermediate_size
        self.backend = options.backend
        self.record_load = False
        # Expert parallelism: this rank holds slots [slot_offset, slot_offset + num_local_slots).
        self.ep_group = options.ep_group
        self.ep_size = dist.get_world_size(self.ep_group) if self.ep_group is not None else 1
        self.ep_rank = dist.get_rank(self.ep_group) if self.ep_group is not None else 0
        self.ep_replicated_tokens = options.ep_replicated_tokens
        if self.ep_group is not None and options.eplb.num_ep_ranks != self.ep_size:
            raise ValueError(f"eplb.num_ep_ranks ({options.eplb.num_ep_ranks}) must equal the expert-parallel "
                             f"group size ({self.ep_size})")
        self.num_local_slots = self.num_slots // self.ep_size
        self.num_ep_ranks = options.eplb.num_ep_ranks  # real (= ep_size) or simulated: what dispatch balances
        self.dispatch = options.eplb.dispatch_rule()
        self.slot_offset = self.ep_rank * self.num_local_slots
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_local_slots, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(self.num_local_slots, hidden_size, intermediate_size))
        experts = range(num_experts)
        set_weight_loader(self.gate_up_proj, self._load_expert, tuple((e, p) for e in experts for p in ("gate", "up")))
        set_weight_loader(self.down_proj, self._load_expert, tuple((e, "down") for e in experts))
        self.max_replicas = self.num_slots - num_experts + 1
        phy2log, log2phy, logcnt = get_policy("none")(
            torch.zeros(1, num_experts), self.num_slots, 1, 1, 1
        )
        # CPU mirrors (weight loading and rebalancing read them without a device sync)
        self.phy2log_cpu = torch.zeros(self.num_slots, dtype=torch.int64, device="cpu")
        self.log2phy_cpu = torch.full((num_experts, self.max_replicas), -1, dtype=torch.int64, device="cpu")
        self.register_buffer("phy2log", torch.zeros(self.num_slots, dtype=torch.int64), persistent=False)
        self.register_buffer("log2phy", torch.zeros(num_experts, self.max_replicas, dtype=torch.int64),
                             persistent=False)
        self.register_buffer("logcnt", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("expert_load", torch.zeros(self.num_slots, dtype=torch.int64), persistent=False)
        self._set_maps(phy2log[0], log2phy[0], logcnt[0])

    # ---- weights --------------------------------------------------------------------------------
    def _load_expert(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: Any = None) -> None:
        """shard_id None: a fused [E, ...] tensor; (e, "gate" | "up" | "down"): expert e's matrix.
        Every replica slot of the expert (on this EP rank) receives a copy."""
        local = slice(self.slot_offset, self.slot_offset + self.num_local_slots)
        if shard_id is None:
            if tensor.shape[0] != self.num_experts:
                raise ValueError(f"fused expert tensor has {tensor.shape[0]} experts, the model {self.num_experts}")
            default_weight_loader(param, tensor[self.phy2log_cpu[local]])
            return
        expert, proj = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} does not exist (the model has {self.num_experts})")
        inter = self.intermediate_size
        replicas = self.log2phy_cpu[expert]
        for slot in replicas[replicas >= 0].tolist():
            if not local.start <= slot < local.stop:
                continue
            target = param.data[slot - self.slot_offset]
            if proj != "down":
                target = target.narrow(0, 0 if proj == "gate" else inter, inter)
            default_weight_loader(target, tensor)

    # ---- placement ------------------------------------------------------------------------------
    def _set_maps(self, phy2log: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor) -> None:
        width = min(log2phy.shape[-1], self.max_replicas)
        if int(logcnt.max()) > self.max_replicas or int(logcnt.min()) < 1:
            raise ValueError(f"replica counts must lie in [1, {self.max_replicas}], got {logcnt.tolist()}")
        self.phy2log_cpu.copy_(phy2log)
        self.log2phy_cpu.fill_(-1)
        self.log2phy_cpu[:, :width] = log2phy[:, :width]
        self.phy2log.copy_(self.phy2log_cpu)
        self.log2phy.copy_(self.log2phy_cpu)
        self.logcnt.copy_(logcnt)

    @torch.no_grad()
    def apply_placement(
        self,
        phy2log: torch.Tensor,  # [P] int64 (CPU)
        log2phy: torch.Tensor,  # [E, R] int64, -1 padded
        logcnt: torch.Tensor,  # [E] int64
    ) -> int:
        """Moves weights so that slot s holds expert phy2log[s]; returns the number of slots rewritten
        (all ranks). Only changed slots are touched, each copied from a replica under the old placement
        (`ep.transfer_plan`: on its own rank when possible, else sent point to point)."""
        phy2log = phy2log.to("cpu", torch.int64)
        if phy2log.shape != (self.num_slots,) or not bool(((phy2log >= 0) & (phy2log < self.num_experts)).all()):
            raise ValueError(f"phy2log must be [{self.num_slots}] logical ids < {self.num_experts}")
        plan = transfer_plan(self.phy2log_cpu, self.log2phy_cpu, phy2log, self.num_local_slots)
        move_expert_weights([self.gate_up_proj.data, self.down_proj.data], plan, self.ep_rank, self.ep_group)
        self._set_maps(phy2log, log2phy.to("cpu", torch.int64), logcnt.to("cpu", torch.int64))
        return len(plan)

    def slot_bytes(self) -> int:
        """Bytes of one slot's weights: what a rebalance moves per rewritten slot."""
        return (self.gate_up_proj[0].numel() + self.down_proj[0].numel()) * self.gate_up_proj.element_size()

    # ---- forward --------------------------------------------------------------------------------
    def to_physical(self, topk_ids: torch.Tensor) -> torch.Tensor:  # [T, k] logical -> [T, k] slots
        if self.dispatch == "least_loaded":
            return self._least_loaded_slots(topk_ids)
        token = torch.arange(topk_ids.shape[0], device=topk_ids.device)[:, None]
        replica = token % self.logcnt[topk_ids]
        return self.log2phy[topk_ids, replica]

    def _least_loaded_slots(self, topk_ids: torch.Tensor) -> torch.Tensor:  # [T, k] logical -> [T, k] slots
        """The batch's (token, expert) pairs of expert e, in batch order, fill e's replicas one after the other,
        each replica taking its share of the least-loaded split of the global counts (scaled to this rank's
        pairs in layer EP). Every rank of engine EP computes the same slots from the same tokens."""
        flat = topk_ids.flatten()  # [n]
        local = torch.bincount(flat, minlength=self.num_experts)  # [E]
        counts = global_expert_counts(local, self.ep_group, self.ep_replicated_tokens)  # [E]
        _, alloc = least_loaded(counts[None, None], self.log2phy[None], self.num_ep_ranks,
                                self.num_slots // self.num_ep_ranks, return_alloc=True)
        share = alloc[0, 0] / counts.clamp_min(1)[:, None].to(alloc.dtype)  # [E, m] fraction per replica
        bounds = (share.cumsum(-1) * local[:, None]).round().to(torch.int64)  # [E, m] end of each replica's run
        order = flat.argsort(stable=True)
        start = local.cumsum(0) - local  # first sorted position of each expert
        position = torch.empty_like(flat)
        position[order] = torch.arange(flat.numel(), device=flat.device) - start[flat[order]]
        replica = torch.minimum((position[:, None] >= bounds[flat]).sum(-1), self.logcnt[flat] - 1)
        return self.log2phy[flat, replica].view_as(topk_ids)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, H]
        topk_weights: torch.Tensor,  # [T, k] fp32
        topk_ids: torch.Tensor,  # [T, k] int64 logical experts
    ) -> torch.Tensor:  # [T, H]
        slots = self.to_physical(topk_ids)
        if self.record_load:
            flat = slots.flatten()
            self.expert_load.scatter_add_(0, flat, torch.ones_like(flat))
        if self.ep_group is not None:
            ep_forward = dispatch_combine_replicated if self.ep_replicated_tokens else dispatch_combine
            return ep_forward(hidden, topk_weights, slots, self.gate_up_proj, self.down_proj, self.ep_group,
                              self.backend)
        return fused_experts(hidden, self.gate_up_proj, self.down_proj, topk_weights, slots, self.backend)


class MoeBlock(nn.Module):
    """Routed experts plus an optional shared expert (gated by sigmoid(x W_g^T) when W_g exists)."""

    def __init__(
        self,
        hidden_size: int,
        moe_intermediate_size: int,
        num_experts: int,
        router: RouterConfig,
        options: MoeOptions,
        *,
        shared_intermediate_size: int = 0,  # 0 = no shared expert
        shared_expert_gate: bool = False,  # Qwen2-MoE's scalar sigmoid gate on the shared expert
        shared_expert_bias: bool = False,  # DeepSeek-V2 with mlp_bias
        hidden_act: str = "silu",
    ):
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"hidden_act {hidden_act!r} is not supported for MoE experts; supported: ['silu']")
        self.gate = MoeGate(hidden_size, num_experts, router)
        self.experts = FusedMoE(num_experts, hidden_size, moe_intermediate_size, options,
                                num_groups=router.num_expert_group or 1)
        self.shared_expert = (GatedMLP(hidden_size, shared_intermediate_size, bias=shared_expert_bias)
                              if shared_intermediate_size else None)
        self.shared_expert_gate = Linear(hidden_size, 1) if shared_expert_gate else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        topk_weights, topk_ids = self.gate(hidden)
        out = self.experts(hidden, topk_weights, topk_ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(hidden)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(hidden)) * shared
            out = out + shared
        return out
