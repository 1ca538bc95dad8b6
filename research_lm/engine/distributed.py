r"""The processes torchrun starts, one per rank: their process groups, and what the ranks must agree on.

Tensor parallelism (`LLM(..., tensor_parallel_size=N)`, `runner.tensor_parallel_size=N`):

    torchrun --nproc-per-node 2 -m research_lm model=<dir> runner.tensor_parallel_size=2
    torchrun --nproc-per-node 2 script.py  # LLM(model, tensor_parallel_size=2); print from rank 0 only

Each rank holds its share of every layer (research_lm/worker/parallel.py: heads and their KV cache, MLP columns,
vocabulary rows; a MoE model's experts shard over the same ranks as expert parallelism) and the layers'
collectives run on `Ranks.group`. Expert parallelism alone (`eplb.expert_parallel`, `eplb.num_ep_ranks` = N):

    torchrun --nproc-per-node 2 -m research_lm model=random-qwen3-moe spec=none baseline=null eplb=deepseek \
        eplb.num_ep_ranks=2 eplb.num_redundant_experts=2 eplb.expert_parallel=true

shards each MoE layer's experts (rank r holds physical slots [r * P/R, (r + 1) * P/R), moved on rebalance point
to point) and replicates the rest (`research_lm.moe.ep`).

Either way the scheduler, the sampler and the drafter are replicated: every rank runs the same requests through
the same schedule, so every rank issues the same collectives in the same order, provided the ranks agree on
everything that shapes the schedule. `Ranks` makes them agree, over a gloo group on the host (no wait on the
device's queue, so async scheduling keeps overlapping):

    KV blocks       the smallest count any rank can afford (free GPU memory differs between ranks)
    runner output   rank 0's sampled and draft tokens: the logits are gathered, identical on every rank, so
                    every rank samples the same tokens; this guards against a kernel whose result depends on
                    timing (a drafter's), which would desynchronise the schedules and hang a collective
    clock           rank 0's, for request arrivals (`research_lm.harness.experiment.serve`)

Every collective is bounded by `distributed_timeout_s` (the process groups' timeout): a rank that dies or hangs
ends the others' runs with `RankLostError`, one line, instead of a hang (gloo raises at once when a peer's
connection closes; NCCL's watchdog aborts the process after the timeout).

Only rank 0 writes results and logs (`research_lm.__main__`); `python -m research_lm` without torchrun
does not touch torch.distributed. Tests: tests/models/test_tensor_parallel.py (gloo, 2 and 4 CPU processes; NCCL
on 2 GPUs, marked gpu) and tests/moe/test_engine_ep.py.
"""

from __future__ import annotations

import atexit
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from research_lm.eplb.settings import EplbSettings
from research_lm.worker.parallel import TensorParallel, guarded


def torchrun_env() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's environment; (0, 0, 1) outside torchrun."""
    env = os.environ
    return int(env.get("RANK", 0)), int(env.get("LOCAL_RANK", 0)), int(env.get("WORLD_SIZE", 1))


def is_main_process() -> bool:
    """Rank 0 of a torchrun launch, or any process outside one: the process that writes results."""
    return torchrun_env()[0] == 0


@dataclass(frozen=True)
class Ranks:
    group: dist.ProcessGroup  # the model's collectives: NCCL on CUDA, gloo on CPU
    cpu_group: dist.ProcessGroup  # gloo: what the ranks agree on, from host values
    rank: int
    world_size: int
    device: torch.device  # this rank's: cuda:LOCAL_RANK, or cpu
    timeout_s: float
    tp: TensorParallel | None  # the layers' group under tensor parallelism; None: expert parallelism alone

    def _guarded(self, what: str):
        return guarded(what, self.rank, self.world_size, self.timeout_s)

    def agree_min(self, value: int) -> int:
        """The smallest `value` over the ranks."""
        t = torch.tensor([value], dtype=torch.int64)
        with self._guarded("agreeing on the KV cache size"):
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def from_rank0(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (pickled)."""
        box = [obj]
        with self._guarded("receiving rank 0's step output"):
            dist.broadcast_object_list(box, group=self.cpu_group, group_src=0)
        return box[0]

    def clock(self) -> float:
        """Rank 0's time.perf_counter(): arrival decisions made from it are the same on every rank."""
        t = torch.tensor([time.perf_counter()], dtype=torch.float64)
        with self._guarded("reading rank 0's clock"):
            dist.broadcast(t, group=self.cpu_group, group_src=0)
        return float(t.item())


def setup_ranks(tensor_parallel_size: int, eplb_config: dict[str, Any] | None, device: torch.device,
                timeout_s: float = 300.0) -> Ranks | None:
    """The ranks of a tensor-parallel run (`tensor_parallel_size` > 1) or of engine expert parallelism
    (`eplb.expert_parallel`); None for a single process. Under tensor parallelism a MoE model's experts shard over
    the same ranks (`sharded_experts`), so `eplb.num_ep_ranks` must be 1 or N."""
    settings = EplbSettings.from_dict(eplb_config)
    if tensor_parallel_size == 1:
        return setup_expert_parallel(eplb_config, device, timeout_s)
    n = tensor_parallel_size
    if settings.num_ep_ranks not in (1, n) or (settings.expert_parallel and settings.num_ep_ranks != n):
        raise ValueError(f"eplb.num_ep_ranks ({settings.num_ep_ranks}) must equal tensor_parallel_size ({n}) (or "
                         "stay 1 without eplb.expert_parallel): a MoE model's experts shard over the tensor-parallel "
                         "ranks")
    rank, world = _world(f"tensor_parallel_size={n} needs one process per rank: launch with torchrun "
                         f"--nproc-per-node {n} (WORLD_SIZE is not set)")
    if world != n:
        raise ValueError(f"tensor_parallel_size ({n}) must equal the number of processes (WORLD_SIZE={world})")
    ranks = _join(rank, world, device, timeout_s)
    tp = TensorParallel(ranks.group, rank, world, timeout_s)
    return Ranks(ranks.group, ranks.cpu_group, rank, world, ranks.device, timeout_s, tp)


def sharded_experts(eplb_config: dict[str, Any] | None, tensor_parallel_size: int) -> dict[str, Any]:
    """The eplb settings a MoE model's layers get under tensor parallelism: engine expert parallelism over the
    tensor-parallel ranks (every rank brings the same tokens, each computes its experts' share of them)."""
    return {**(eplb_config or {}), "expert_parallel": True, "num_ep_ranks": tensor_parallel_size}


def setup_expert_parallel(eplb_config: dict[str, Any] | None, device: torch.device,
                          timeout_s: float = 300.0) -> Ranks | None:
    """None unless `eplb.expert_parallel`. Then the group of all torchrun ranks, created here the first time
    (NCCL on CUDA, this process on GPU LOCAL_RANK; gloo on CPU) or the default group a script created;
    `eplb.num_ep_ranks` must equal its size."""
    settings = EplbSettings.from_dict(eplb_config)
    if not settings.expert_parallel:
        return None
    rank, world = _world("eplb.expert_parallel needs one process per EP rank: launch with torchrun "
                         f"--nproc-per-node {settings.num_ep_ranks} (WORLD_SIZE is not set)")
    if settings.num_ep_ranks != world:
        raise ValueError(f"eplb.num_ep_ranks ({settings.num_ep_ranks}) must equal the number of processes "
                         f"(WORLD_SIZE={world}) when eplb.expert_parallel is on")
    return _join(rank, world, device, timeout_s)


def _world(not_launched: str) -> tuple[int, int]:
    """(rank, world size) of the default group a script created, or of torchrun's environment."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "WORLD_SIZE" not in os.environ:
        raise ValueError(not_launched)
    rank, _, world = torchrun_env()
    return rank, world


def _join(rank: int, world: int, device: torch.device, timeout_s: float) -> Ranks:
    """The default group (created here unless a script did; its timeout bounds every collective), a gloo group
    for host values beside an NCCL one, and this rank's device."""
    if device.type == "cuda":  # a script's own group may come without LOCAL_RANK: one GPU per rank
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        with guarded("joining the process group", rank, world, timeout_s):
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                                    timeout=timeout)
        atexit.register(_destroy_process_group)
    group = dist.group.WORLD
    cpu_group = group if dist.get_backend(group) == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    if device.type == "cuda":  # NCCL creates its communicator at the first collective: not inside a graph capture
        with guarded("the first all-reduce", rank, world, timeout_s):
            dist.all_reduce(torch.zeros(1, device=device), group=group)
    return Ranks(group, cpu_group, rank, world, device, timeout_s, None)


def _destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
