"""Step input buffers, allocated once and sliced each step (CUDA graphs need fixed addresses)."""

from __future__ import annotations

import torch


class CpuGpuBuffer:
    """A host buffer (numpy view `.np` over pinned `.cpu`) mirrored on the device (`.gpu`)."""

    def __init__(self, *shape: int, dtype: torch.dtype, device: torch.device,
                 views: tuple[torch.Tensor, torch.Tensor] | None = None):
        """views: (host, device) tensors of this shape and dtype inside a larger pair of buffers (`StepBuffers`)."""
        pin = device.type == "cuda"
        if views is None:
            views = (torch.zeros(*shape, dtype=dtype, pin_memory=pin),
                     None if device.type == "cpu" else torch.zeros(*shape, dtype=dtype, device=device))
        self.cpu, gpu = views
        self.np = self.cpu.numpy()
        self.gpu = self.cpu if gpu is None else gpu

    def copy_to_gpu(self, n: int | None = None) -> torch.Tensor:
        """Copy the first n rows host -> device (non-blocking from pinned memory); return that slice."""
        if self.gpu is self.cpu:
            return self.gpu if n is None else self.gpu[:n]
        if n is None:
            return self.gpu.copy_(self.cpu, non_blocking=True)
        return self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)


class StepBuffers:
    """Every per-step input of the forward, sized by max_num_tokens / max_num_reqs.

    The 1-D inputs live side by side in one host and one device buffer, so a step moves them with one copy
    (`copy_inputs_to_gpu`): each host -> device copy costs the host ~20 us of driver time, more than the bytes
    of all of them at these sizes. The block table stays apart: its live corner is copied alone, since its
    full size grows with max_model_len."""

    _ALIGN = 64  # bytes: every view starts aligned for its dtype

    def __init__(self, max_num_tokens: int, max_num_reqs: int, max_blocks_per_req: int, device: torch.device):
        self.max_num_tokens = max_num_tokens
        self.max_num_reqs = max_num_reqs
        t, r = max_num_tokens, max_num_reqs
        fields = {  # name: (length, dtype)
            "input_ids": (t, torch.int64), "positions": (t, torch.int64), "slot_mapping": (t, torch.int64),
            "logits_indices": (t, torch.int64), "query_start_loc": (r + 1, torch.int32),
            "seq_lens": (r, torch.int32), "num_computed": (r, torch.int32), "request_rows": (r, torch.int32),
        }
        offsets, size = {}, 0
        for name, (n, dtype) in fields.items():
            offsets[name] = size
            size += -(-n * dtype.itemsize // self._ALIGN) * self._ALIGN
        pin = device.type == "cuda"
        self._host = torch.zeros(size, dtype=torch.uint8, pin_memory=pin)
        self._device = None if device.type == "cpu" else torch.zeros(size, dtype=torch.uint8, device=device)
        for name, (n, dtype) in fields.items():
            span = slice(offsets[name], offsets[name] + n * dtype.itemsize)
            views = (self._host[span].view(dtype), None if self._device is None else self._device[span].view(dtype))
            setattr(self, name, CpuGpuBuffer(n, dtype=dtype, device=device, views=views))
        self.input_ids: CpuGpuBuffer  # [T]
        self.positions: CpuGpuBuffer  # [T]
        self.slot_mapping: CpuGpuBuffer  # [T]
        self.logits_indices: CpuGpuBuffer  # [S]
        self.query_start_loc: CpuGpuBuffer  # [R+1]
        self.seq_lens: CpuGpuBuffer  # [R]
        self.num_computed: CpuGpuBuffer  # [R]
        self.request_rows: CpuGpuBuffer  # [R]
        self.block_table = CpuGpuBuffer(max_num_reqs, max_blocks_per_req, dtype=torch.int32, device=device)

    def copy_inputs_to_gpu(self) -> None:
        """Every 1-D input host -> device in one non-blocking copy (the block table is not among them)."""
        if self._device is not None:
            self._device.copy_(self._host, non_blocking=True)


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
