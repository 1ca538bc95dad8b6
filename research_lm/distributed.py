r"""Engine-level expert parallelism over the processes torchrun starts: the process group, and what the ranks
must agree on.

    torchrun --nproc-per-node 2 -m research_lm model=random-qwen3-moe spec=none baseline=null eplb=deepseek \
        eplb.num_ep_ranks=2 eplb.num_redundant_experts=2 eplb.expert_parallel=true
    # or, in a script run by torchrun:
    LLM(model, eplb_config={"policy": "deepseek", "num_ep_ranks": 2, "expert_parallel": True, ...})

What is sharded, what is replicated: each MoE layer's experts are sharded (rank r holds physical slots
[r * P/R, (r + 1) * P/R), loaded from the checkpoint and moved on rebalance point to point); embeddings,
attention, dense MLPs, routers, the KV cache, the scheduler and the sampler are replicated: every rank runs
the same requests through the same schedule, and each MoE layer splits the step's tokens between the
ranks for its all-to-all (`research_lm.moe.ep`). So every rank issues the same collectives in the same
order, provided the ranks agree on everything that shapes the schedule. `ExpertParallel` makes them agree:

    KV blocks       the smallest count any rank can afford (free GPU memory differs between ranks)
    runner output   rank 0's sampled and draft tokens: identical logits give identical tokens, and this
                    guards against a kernel whose result depends on timing, which would desynchronise the
                    schedules and hang a collective
    clock           rank 0's, for request arrivals (`research_lm.experiment.serve`)

Only rank 0 writes results and logs (`research_lm.__main__`); `python -m research_lm` without torchrun
does not touch torch.distributed. tests/moe/test_engine_ep.py runs `LLM` on 2 processes (gloo on CPU; NCCL
on 2 GPUs, marked gpu) through rebalances that send experts between ranks, against a single-process run:
identical greedy tokens, placements and EPLB metrics, and each rank holding only its slots.
"""

from __future__ import annotations

import atexit
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from research_lm.eplb.settings import EplbSettings


def torchrun_env() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's environment; (0, 0, 1) outside torchrun."""
    env = os.environ
    return int(env.get("RANK", 0)), int(env.get("LOCAL_RANK", 0)), int(env.get("WORLD_SIZE", 1))


def is_main_process() -> bool:
    """Rank 0 of a torchrun launch, or any process outside one: the process that writes results."""
    return torchrun_env()[0] == 0


@dataclass(frozen=True)
class ExpertParallel:
    group: dist.ProcessGroup
    rank: int
    world_size: int
    device: torch.device  # this rank's: cuda:LOCAL_RANK, or cpu

    def agree_min(self, value: int) -> int:
        """The smallest `value` over the ranks."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def from_rank0(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (pickled)."""
        box = [obj]
        dist.broadcast_object_list(box, group=self.group, group_src=0, device=self.device)
        return box[0]

    def clock(self) -> float:
        """Rank 0's time.perf_counter(): arrival decisions made from it are the same on every rank."""
        t = torch.tensor([time.perf_counter()], dtype=torch.float64, device=self.device)
        dist.broadcast(t, group=self.group, group_src=0)
        return float(t.item())


def setup_expert_parallel(eplb_config: dict[str, Any] | None, device: torch.device) -> ExpertParallel | None:
    """None unless `eplb.expert_parallel`. Then the group of all torchrun ranks, created here the first time
    (NCCL on CUDA, this process on GPU LOCAL_RANK; gloo on CPU) or the default group a script created;
    `eplb.num_ep_ranks` must equal its size."""
    settings = EplbSettings.from_dict(eplb_config)
    if not settings.expert_parallel:
        return None
    rank, _, world = torchrun_env()
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    elif "WORLD_SIZE" not in os.environ:
        raise ValueError("eplb.expert_parallel needs one process per EP rank: launch with torchrun "
                         f"--nproc-per-node {settings.num_ep_ranks} (WORLD_SIZE is not set)")
    if settings.num_ep_ranks != world:
        raise ValueError(f"eplb.num_ep_ranks ({settings.num_ep_ranks}) must equal the number of processes "
                         f"(WORLD_SIZE={world}) when eplb.expert_parallel is on")
    if device.type == "cuda":  # a script's own group may come without LOCAL_RANK: one GPU per rank
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
        atexit.register(_destroy_process_group)
    return ExpertParallel(dist.group.WORLD, rank, world, device)


def _destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
