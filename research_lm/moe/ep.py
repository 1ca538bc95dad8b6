r"""Expert parallelism (EP) over torch.distributed: rank r of R holds physical slots [r * P/R, (r + 1) * P/R).

Two ways in, one all-to-all:

  engine EP (`eplb.expert_parallel`, launched with torchrun; research_lm.engine.distributed builds the group):
      attention replicated, experts sharded; token shards for the all-to-all. Every rank runs the same
      requests through the same schedule, so every MoE layer sees the same T tokens on every rank and
      routes them alike. Rank r dispatches only its contiguous shard [r * c, (r + 1) * c), c = ceil(T / R)
      (the last shards short or empty), then an all-gather of the c-row shard outputs (zero padded)
      gives every rank all T rows (`dispatch_combine_replicated`). Replicated dense compute keeps the
      runner untouched; sharding the tokens keeps each token's expert compute done once.
  layer EP (an `ep_group` without `expert_parallel`, e.g. data-parallel attention in your own script):
      each rank brings its own tokens and gets their outputs (`dispatch_combine`).

The all-to-all, for the pairs of one rank's tokens:

    pairs sorted by destination rank ──all_to_all(counts)──▶ split sizes (one host sync per layer)
    ──all_to_all(rows, local slot ids, weights)──▶ each rank runs its local slots (fused_experts)
    ──all_to_all(outputs)──▶ back in pair order; y[t] = Σ_j out[t, j] in a fixed order

so a rank's outputs equal the single-process layer's for the same tokens. A rebalance moves weights
point to point (`move_expert_weights`): every rank derives the same transfer plan from the old and new
maps (all ranks run the policy on the same load: all-reduced in layer EP, rank 0's in engine EP, where
every rank already counts every token), a slot prefers a source replica on its own rank, and sends are
snapshots, so a slot can be a source and a destination in the same rebalance.

The process group comes in `ModelBuildContext.extra["ep_group"]` (never a global); `eplb.num_ep_ranks`
must equal its size. Launch engine EP with one process per GPU (NCCL; gloo on CPU runs the same code):

    torchrun --nproc-per-node 2 -m research_lm model=random-qwen3-moe spec=none baseline=null eplb=deepseek \
        eplb.num_ep_ranks=2 eplb.num_redundant_experts=2 eplb.expert_parallel=true
    torchrun --nproc-per-node 2 script.py  # LLM(model, eplb_config={..., "num_ep_ranks": 2, "expert_parallel": True})

tests/moe/test_ep.py checks the layer against the single-process layer (and a rebalance);
tests/moe/test_engine_ep.py runs the engine on 2 ranks against a single-process run (tokens, placements,
each rank's slots).
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


def dispatch_combine_replicated(
    hidden: torch.Tensor,  # [T, H] the same tokens on every rank
    topk_weights: torch.Tensor,  # [T, k] fp32
    topk_slots: torch.Tensor,  # [T, k] int64 global physical slots
    w13: torch.Tensor,  # [P/R, 2I, H] this rank's slots
    w2: torch.Tensor,  # [P/R, H, I]
    group: dist.ProcessGroup | None,
    backend: str = "torch",
) -> torch.Tensor:  # [T, H] on every rank
    """Engine EP: this rank dispatches its shard of the tokens, then every rank gathers all shards' outputs."""
    num_tokens, hidden_size = hidden.shape
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    shard = -(-num_tokens // world)  # rows per rank, padded so that every all-gather piece has one size
    lo, hi = min(rank * shard, num_tokens), min((rank + 1) * shard, num_tokens)
    mine = dispatch_combine(hidden[lo:hi], topk_weights[lo:hi], topk_slots[lo:hi], w13, w2, group, backend)
    padded = hidden.new_zeros(shard, hidden_size)
    padded[: hi - lo] = mine
    pieces = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(pieces, padded, group=group)
    return torch.cat(pieces)[:num_tokens]


def global_expert_counts(
    local: torch.Tensor,  # [E] int64 this rank's (token, expert) pairs per expert
    group: dist.ProcessGroup | None,
    replicated_tokens: bool,
) -> torch.Tensor:  # [E] the pairs of every rank's tokens
    """What least-loaded dispatch balances: layer EP all-reduces the counts (one [E] all-reduce per layer); engine
    EP and a single process already count every token."""
    if group is None or replicated_tokens:
        return local
    total = local.clone()
    dist.all_reduce(total, group=group)
    return total


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
