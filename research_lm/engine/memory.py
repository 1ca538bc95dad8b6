"""How many KV blocks fit: from `num_gpu_blocks`, or from `gpu_memory_utilization` after profiling."""

from __future__ import annotations

import os

import torch


def profile_peak_activation_bytes(run_dummy_forward) -> int:
    """Peak extra CUDA memory of one worst-case forward (max_num_batched_tokens through the model)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    run_dummy_forward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    torch.cuda.empty_cache()
    return peak


PREFIX_CACHE_HEADROOM = 8  # CUDA: at most this many times the blocks every sequence needs at full length


def num_kv_blocks(
    *,
    page_size_bytes: int,  # one block over all layers
    device: torch.device,
    gpu_memory_utilization: float,
    num_gpu_blocks: int | None,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
    activation_bytes: int = 0,
    state_bytes: int = 0,  # per-request state (Mamba slots), allocated before the blocks
    num_lookahead_tokens: int = 0,  # a drafter's slots past the verified tokens
) -> int:
    """CUDA: the blocks that fit in `utilization × total` after weights and activations, but at most
    PREFIX_CACHE_HEADROOM times what every sequence needs at full length: beyond that, blocks only hold more
    prefix cache, and each costs Python bookkeeping (a tiny model in 0.9 of an H200 would get millions).
    CPU: enough for every sequence at full length (+ the null block), capped at that fraction of
    half the RAM, since a CPU run shares memory with everything else."""
    if num_gpu_blocks is not None:
        return num_gpu_blocks
    wanted = max_num_seqs * -(-(max_model_len + num_lookahead_tokens) // block_size) + 1
    if page_size_bytes == 0:  # no paged layers (pure Mamba): block ids cost nothing, give every request its own
        return wanted
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = total * gpu_memory_utilization - (total - free) - activation_bytes - state_bytes
    else:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        budget = min(wanted * page_size_bytes, ram * 0.5 * gpu_memory_utilization - state_bytes)
    num_blocks = min(int(budget // page_size_bytes), PREFIX_CACHE_HEADROOM * wanted)
    if num_blocks < 2:
        raise ValueError(
            f"no memory left for the KV cache (budget {budget / 2**30:.2f} GiB, one block "
            f"{page_size_bytes / 2**20:.2f} MiB): raise gpu_memory_utilization or lower max_num_batched_tokens"
        )
    return num_blocks
