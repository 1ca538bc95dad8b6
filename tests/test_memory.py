"""KV block budget (research_lm/engine/memory.py): what fits in memory, capped at a multiple of what is useful."""

from __future__ import annotations

import torch

from research_lm.engine.memory import PREFIX_CACHE_HEADROOM, num_kv_blocks

GIB = 2**30


def _cuda_blocks(monkeypatch, free: int, total: int, page: int, **kw) -> int:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    args = dict(page_size_bytes=page, device=torch.device("cuda"), gpu_memory_utilization=0.9, num_gpu_blocks=None,
                max_num_seqs=4, max_model_len=64, block_size=16)
    return num_kv_blocks(**(args | kw))


def test_a_tiny_model_on_a_big_gpu_gets_headroom_not_millions_of_blocks(monkeypatch):
    wanted = 4 * (64 // 16) + 1  # every sequence at full length + the null block
    assert _cuda_blocks(monkeypatch, 139 * GIB, 140 * GIB, page=32 * 1024) == PREFIX_CACHE_HEADROOM * wanted


def test_memory_limits_before_the_cap(monkeypatch):
    # 0.9 * 10 GiB - 1 GiB in use - 1 GiB activations = 7 GiB of 1 GiB blocks
    got = _cuda_blocks(monkeypatch, 9 * GIB, 10 * GIB, page=GIB, activation_bytes=GIB, max_num_seqs=64,
                       max_model_len=4096)
    assert got == 7


def test_num_gpu_blocks_overrides(monkeypatch):
    assert _cuda_blocks(monkeypatch, 139 * GIB, 140 * GIB, page=1024, num_gpu_blocks=5) == 5
