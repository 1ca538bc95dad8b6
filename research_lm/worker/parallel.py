"""Tensor parallelism's building block: the group a model's layers shard over, its two collectives, and the
error a lost rank raises.

A layer built with a `TensorParallel` holds rank r's share of its weights (`split`: heads, vocabulary rows,
intermediate columns) and calls `all_reduce` (row-parallel outputs, the vocab-parallel embedding) or
`all_gather` (vocab-parallel logits). The handle travels in `ModelBuildContext.tp`, never in a global, so a
replicated drafter and a sharded target live in one process. research_lm/engine/distributed.py creates the group.

A collective that fails (gloo: a peer closed its connection, or no answer within the group's timeout) raises
`RankLostError`, one line naming the rank and the cause, so a run whose rank died ends instead of hanging.
NCCL reports such failures asynchronously (its watchdog aborts the process after the same timeout).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from research_lm.api.errors import RankLostError

__all__ = ["RankLostError", "TensorParallel", "guarded"]


@contextlib.contextmanager
def guarded(what: str, rank: int, world_size: int, timeout_s: float) -> Iterator[None]:
    """Turn a failed collective into a `RankLostError` whose one line says which rank saw what."""
    try:
        yield
    except RuntimeError as e:
        # torch's distributed errors, and gloo's transport errors (plain RuntimeErrors naming gloo); anything else
        # (e.g. a CUDA error) is not about the other ranks
        if isinstance(e, RankLostError) or not (isinstance(e, dist.DistError) or "gloo" in str(e)):
            raise
        cause = (str(e).splitlines() or [type(e).__name__])[0][:300]
        raise RankLostError(
            f"rank {rank} of {world_size}: {what} failed because another rank exited or did not answer within "
            f"distributed_timeout_s={timeout_s:g} ({cause})"
        ) from None


@dataclass(frozen=True)
class TensorParallel:
    group: dist.ProcessGroup
    rank: int
    size: int
    timeout_s: float = 300.0  # the group's, for the error message

    def split(self, n: int, what: str) -> int:
        """This rank's share of n (heads, vocabulary rows, ...); `what` names the config field when n does not
        divide evenly."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size ({self.size})")
        return n // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:  # [...] partial sums -> [...] summed, in place
        with guarded("an all-reduce", self.rank, self.size, self.timeout_s):
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:  # [n, d] this rank's columns -> [n, size * d]
        """The ranks' column blocks side by side, rank order (one all-gather into a [size, n, d] buffer)."""
        x = x.contiguous()
        out = x.new_empty(self.size * x.shape[0], x.shape[1])
        with guarded("an all-gather", self.rank, self.size, self.timeout_s):
            dist.all_gather_into_tensor(out, x, group=self.group)
        return out.view(self.size, x.shape[0], x.shape[1]).transpose(0, 1).reshape(x.shape[0], -1)


def split_size(n: int, tp: TensorParallel | None, what: str) -> int:
    """n, or this rank's share of it under tensor parallelism."""
    return n if tp is None else tp.split(n, what)
