"""Step input buffers, allocated once and sliced each step (CUDA graphs need fixed addresses)."""

from __future__ import annotations

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
        # A step's counts in one host -> device copy (worker/step_inputs.py): for a step padded to b requests,
        # [table row (b) | query_start_loc (b + 1) | computed-count delta (b) | samples (b) | logits rows].
        self.staging = CpuGpuBuffer(4 * max_num_reqs + 1 + max_num_tokens, dtype=torch.int64, device=device)
        # Fires when a step's copies have left the pinned host buffers, which the next step overwrites.
        self.copied = torch.cuda.Event() if device.type == "cuda" else None

    def copy_block_table(self, num_reqs: int, num_cols: int) -> torch.Tensor:
        """Copy only the live corner of the block table; kernels read rows through their stride."""
        bt = self.block_table
        if bt.gpu is not bt.cpu:
            bt.gpu[:num_reqs, :num_cols].copy_(bt.cpu[:num_reqs, :num_cols], non_blocking=True)
        return bt.gpu[:num_reqs]


class HostIds:
    """A step's results (int64) on their way to pinned host memory, without waiting for them: two buffers (and
    events) alternate, since `collect` reads one step's while the next step's are being copied."""

    def __init__(self, max_num_tokens: int, device: torch.device):
        pin = device.type == "cuda"
        self.buffers = [torch.zeros(max_num_tokens, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self.events = [torch.cuda.Event() for _ in range(2)] if pin else [None, None]
        self.next = 0

    def start_copy(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Enqueue ids [n] int64 -> host; the host view, and the event that fires when it holds them (CPU: None)."""
        host, event = self.buffers[self.next][: len(ids)], self.events[self.next]
        self.next ^= 1
        host.copy_(ids, non_blocking=event is not None)
        if event is not None:
            event.record()
        return host, event
