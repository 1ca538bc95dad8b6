"""Step input buffers, allocated once and sliced each step (CUDA graphs need fixed addresses)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


class CpuGpuBuffer:
    """A host buffer (numpy view `.np` over pinned `.cpu`) mirrored on the device (`.gpu`)."""

    def __init__(self, *shape: int, dtype: torch.dtype, device: torch.device):
        pin = device.type == "cuda"
        self.cpu = torch.zeros(*shape, dtype=dtype, pin_memory=pin)
        self.np = self.cpu.numpy()
        self.gpu = self.cpu if device.type == "cpu" else torch.zeros(*shape, dtype=dtype, device=device)

    def copy_to_gpu(self, n: int | None = None) -> torch.Tensor:
        """Copy the first n rows host -> device (non-blocking from pinned memory); return that slice."""
        if self.gpu is self.cpu:
            return self.gpu if n is None else self.gpu[:n]
        if n is None:
            return self.gpu.copy_(self.cpu, non_blocking=True)
        return self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)


class StepBuffers:
    """Every per-step input of the forward, sized by max_num_batched_tokens / max_num_seqs."""

    def __init__(self, max_num_tokens: int, max_num_reqs: int, max_blocks_per_req: int, device: torch.device):
        self.max_num_tokens = max_num_tokens
        self.max_num_reqs = max_num_reqs
        self.input_ids = CpuGpuBuffer(max_num_tokens, dtype=torch.int64, device=device)  # [T]
        self.positions = CpuGpuBuffer(max_num_tokens, dtype=torch.int64, device=device)  # [T]
        self.slot_mapping = CpuGpuBuffer(max_num_tokens, dtype=torch.int64, device=device)  # [T]
        self.logits_indices = CpuGpuBuffer(max_num_tokens, dtype=torch.int64, device=device)  # [S]
        self.query_start_loc = CpuGpuBuffer(max_num_reqs + 1, dtype=torch.int32, device=device)  # [R+1]
        self.seq_lens = CpuGpuBuffer(max_num_reqs, dtype=torch.int32, device=device)  # [R]
        self.num_computed = CpuGpuBuffer(max_num_reqs, dtype=torch.int32, device=device)  # [R]
        self.request_rows = CpuGpuBuffer(max_num_reqs, dtype=torch.int32, device=device)  # [R]
        self.block_table = CpuGpuBuffer(max_num_reqs, max_blocks_per_req, dtype=torch.int32, device=device)
        # A uniform graph step's inputs in one copy (`ModelRunner._prepare_uniform`): per token its value, or
        # -1 - its index in the device tokens holding it; then per request its start position, then its row; then n;
        # then, for a step launched before the last was verified, per request its index in the start shifts.
        self.staging = CpuGpuBuffer(max_num_tokens + 3 * max_num_reqs + 1, dtype=torch.int64, device=device)
        # PLACEHOLDER inputs: token rows [:h], then the flat index of each one's token in its `DeviceTokens` [h:2h]
        self.holes = CpuGpuBuffer(2 * max_num_tokens, dtype=torch.int64, device=device)

    def copy_block_table(self, num_reqs: int, num_cols: int) -> torch.Tensor:
        """Copy only the live corner of the block table; kernels read rows through their stride."""
        bt = self.block_table
        if bt.gpu is not bt.cpu:
            bt.gpu[:num_reqs, :num_cols].copy_(bt.cpu[:num_reqs, :num_cols], non_blocking=True)
        return bt.gpu[:num_reqs]


@dataclass
class DeviceTokens:
    """Tokens on the device that the host has not seen yet (sampled by a launched step, or drafted): a
    request's j-th one is ids[first[request id] + j * stride]."""

    ids: torch.Tensor  # 1-D
    first: dict[str, int]
    stride: int = 1
    # A speculative step's next inputs (its newest token, then its drafts), left before the host knows how many
    # drafts it accepted: the host stages each request's next start as if it accepted all of them, and the request's
    # true start is that plus start_shift[first[request id]] (<= 0).
    start_shift: torch.Tensor | None = None



class HostIds:
    """Sampled token ids on their way to pinned host memory, without waiting for them: two buffers (and
    events) alternate, since `collect` reads one step's ids while the next step's are being copied."""

    def __init__(self, max_num_tokens: int, device: torch.device):
        pin = device.type == "cuda"
        self.buffers = [torch.zeros(max_num_tokens, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self.events = [torch.cuda.Event() for _ in range(2)] if pin else [None, None]
        self.next = 0

    def start_copy(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Enqueue ids [n] -> host; the host view, and the event that fires when it holds them (CPU: None)."""
        host, event = self.buffers[self.next][: len(ids)], self.events[self.next]
        self.next ^= 1
        host.copy_(ids, non_blocking=event is not None)
        if event is not None:
            event.record()
        return host, event
