"""Expert parallelism (EP) over torch.distributed: rank r of R holds physical slots [r * P/R, (r + 1) * P/R).

Each rank runs attention on its own tokens (data parallel) and calls the MoE layer with them; the
layer sends every (token, expert) pair to the rank holding the chosen slot and gets the weighted
expert output back:

    pairs sorted by destination rank ──all_to_all(counts)──▶ split sizes (one host sync per layer)
    ──all_to_all(rows, local slot ids, weights)──▶ each rank runs its local slots (fused_experts)
    ──all_to_all(outputs)──▶ back in pair order; y[t] = Σ_j out[t, j] in a fixed order

so a rank's outputs equal the single-process layer's for the same tokens. A rebalance moves weights
point to point (`move_expert_weights`): every rank derives the same transfer plan from the old and new
maps (all ranks run the policy on the all-reduced load), a slot prefers a source replica on its own
rank, and sends are snapshots, so a slot can be a source and a destination in the same rebalance.

The process group comes in `ModelBuildContext.extra["ep_group"]` (never a global); `eplb.num_ep_ranks`
must equal its size. Launch: one process per GPU, e.g.
    torchrun --nproc-per-node 2 your_script.py   # dist.init_process_group("nccl"); extra={"ep_group": group, ...}
NCCL needs CUDA tensors; gloo (CPU) runs the same code path in the tests.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from research_lm.moe.experts import fused_experts


def _all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> None:
    dist.all_to_all_single(out, inp.contiguous(), out_splits, in_splits, group=group)


def dispatch_combine(
    hidden: torch.Tensor,  # [T, H] this rank's tokens
    topk_weights: torch.Tensor,  # [T, k] fp32
    topk_slots: torch.Tensor,  # [T, k] int64 global physical slots
    w13: torch.Tensor,  # [P/R, 2I, H] this rank's slots
    w2: torch.Tensor,  # [P/R, H, I]
    group: dist.ProcessGroup | None,
    backend: str = "torch",
) -> torch.Tensor:  # [T, H]
    num_tokens, top_k = topk_slots.shape
    hidden_size = hidden.shape[1]
    world = dist.get_world_size(group)
    slots_per_rank = w13.shape[0]
    flat = topk_slots.flatten()
    dest = flat // slots_per_rank
    order = dest.argsort(stable=True)  # pairs grouped by destination rank
    send_counts = torch.bincount(dest, minlength=world)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
    num_recv = sum(recv_splits)

    recv_x = hidden.new_empty(num_recv, hidden_size)
    _all_to_all(recv_x, hidden[order // top_k], recv_splits, send_splits, group)
    recv_slot = flat.new_empty(num_recv)
    _all_to_all(recv_slot, flat[order] - dest[order] * slots_per_rank, recv_splits, send_splits, group)
    recv_w = topk_weights.new_empty(num_recv)
    _all_to_all(recv_w, topk_weights.flatten()[order], recv_splits, send_splits, group)

    local_out = fused_experts(recv_x, w13, w2, recv_w[:, None], recv_slot[:, None], backend)  # [num_recv, H]
    back = hidden.new_empty(num_tokens * top_k, hidden_size)
    _all_to_all(back, local_out, send_splits, recv_splits, group)
    out = torch.empty_like(back)
    out[order] = back
    return out.view(num_tokens, top_k, hidden_size).sum(dim=1)


def transfer_plan(
    old_phy2log: torch.Tensor,  # [P] CPU
    old_log2phy: torch.Tensor,  # [E, R] CPU, -1 padded
    new_phy2log: torch.Tensor,  # [P] CPU
    slots_per_rank: int,
) -> list[tuple[int, int]]:  # (destination slot, source slot) for every slot whose expert changes
    """The same list on every rank: a changed slot copies its new expert from an old replica on its own
    rank when there is one (no communication), else from the expert's first old replica."""
    plan = []
    for dst in (new_phy2log != old_phy2log).nonzero().flatten().tolist():
        replicas = old_log2phy[int(new_phy2log[dst])]
        replicas = replicas[replicas >= 0].tolist()
        local = [s for s in replicas if s // slots_per_rank == dst // slots_per_rank]
        plan.append((dst, (local or replicas)[0]))
    return plan


@torch.no_grad()
def move_expert_weights(
    params: list[torch.Tensor],  # this rank's slot-stacked parameters, each [P/R, ...]
    plan: list[tuple[int, int]],  # from `transfer_plan`
    rank: int,
    group: dist.ProcessGroup | None,
) -> None:
    """Executes the plan: local copies and point-to-point sends/receives of whole slots (all parameters of
    a slot packed in one message), then writes the received slots in place."""
    per_rank = params[0].shape[0]
    sizes = [p[0].numel() for p in params]

    def pack(local_slot: int) -> torch.Tensor:  # a snapshot: the slot may be overwritten below
        return torch.cat([p[local_slot].reshape(-1) for p in params])

    ops, incoming = [], []
    for dst, src in plan:
        dst_rank, src_rank = dst // per_rank, src // per_rank
        if src_rank == rank:
            payload = pack(src - rank * per_rank)
            if dst_rank == rank:
                incoming.append((dst, payload))
            else:
                ops.append(dist.P2POp(dist.isend, payload, dist.get_global_rank(group, dst_rank)
                                      if group is not None else dst_rank, group=group, tag=dst))
        elif dst_rank == rank:
            buf = params[0].new_empty(sum(sizes))
            ops.append(dist.P2POp(dist.irecv, buf, dist.get_global_rank(group, src_rank)
                                  if group is not None else src_rank, group=group, tag=dst))
            incoming.append((dst, buf))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for dst, buf in incoming:
        for p, piece in zip(params, buf.split(sizes)):
            p[dst - rank * per_rank].copy_(piece.view_as(p[0]))
