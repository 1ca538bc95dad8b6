"""Expert-load recording: a sliding window of per-step token counts per physical expert."""

from __future__ import annotations

import torch


class ExpertLoadWindow:
    """Ring buffer of the last `window` steps of expert load, [window, num_layers, num_physical].

    The MoE layer calls `record(step_load)` once per step with the tokens routed to each physical
    expert of each layer (a device tensor: recording is one copy, no host sync); the EPLB step reads
    `windowed()` (the sum over the recorded steps, at most `window`) and maps it to logical experts
    with `physical_to_logical`. Physical slot ids mean something only under one placement: call
    `reset()` after a rebalance, or the window mixes loads of two placements.
    """

    def __init__(self, num_layers: int, num_physical: int, window: int, *,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.int64) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.buffer = torch.zeros(window, num_layers, num_physical, dtype=dtype, device=device)
        self.window = window
        self.num_recorded = 0  # steps recorded since the last reset

    def record(self, step_load: torch.Tensor) -> None:
        """step_load: [num_layers, num_physical] tokens routed to each physical expert this step."""
        if step_load.shape != self.buffer.shape[1:]:
            raise ValueError(f"step_load must have shape {tuple(self.buffer.shape[1:])}, "
                             f"got {tuple(step_load.shape)}")
        self.buffer[self.num_recorded % self.window].copy_(step_load)
        self.num_recorded += 1

    @property
    def num_steps(self) -> int:
        """Steps currently in the window."""
        return min(self.num_recorded, self.window)

    def windowed(self) -> torch.Tensor:
        """[num_layers, num_physical] load summed over the steps in the window (unfilled rows are 0)."""
        return self.buffer.sum(0)

    def history(self, num_buckets: int) -> torch.Tensor:
        """[B, num_layers, num_physical]: the steps in the window, oldest first, summed into B = min(num_buckets,
        steps) contiguous buckets (`bucket_history`); a policy with `history_buckets` gets this."""
        n = self.num_steps
        start = self.num_recorded - n  # the oldest step still in the window
        rows = (torch.arange(start, start + n, device=self.buffer.device) % self.window) if n else None
        steps = self.buffer[rows] if n else self.buffer[:1]  # no step yet: one bucket of zeros
        return bucket_history(steps, num_buckets)

    def reset(self) -> None:
        self.buffer.zero_()
        self.num_recorded = 0


def bucket_history(steps: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """[T, ...] per-step load -> [B, ...], B = min(num_buckets, T): contiguous runs of steps summed, oldest first
    (run lengths differ by at most one). Buckets average out per-step noise and bound what a rebalance sends."""
    if num_buckets < 1:
        raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
    num_steps = steps.shape[0]
    buckets = min(num_buckets, num_steps)
    bucket_of_step = torch.arange(num_steps, device=steps.device) * buckets // num_steps  # [T]
    out = steps.new_zeros(buckets, *steps.shape[1:])
    return out.index_add_(0, bucket_of_step, steps)


def physical_to_logical(physical_load: torch.Tensor, phy2log: torch.Tensor, num_logical: int) -> torch.Tensor:
    """Adds the load of every replica into its logical expert: [..., L, P] -> [..., L, num_logical]."""
    index = phy2log.to(physical_load.device).expand_as(physical_load)
    out = torch.zeros(*physical_load.shape[:-1], num_logical, dtype=physical_load.dtype,
                      device=physical_load.device)
    return out.scatter_add_(-1, index, physical_load)
