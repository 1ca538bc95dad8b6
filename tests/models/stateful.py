"""Helpers for models with per-request state (Mamba): drive them without the runner, and check the
whole engine's greedy output against transformers.

`StateBatch` is like `tests.utils.PagedBatch`, but every `CacheLayer` gets its cache from its backend's
`allocate_cache` (paged KV for attention, state slots for Mamba), and sequence i may live in any
state slot (`slots`), so tests can reuse and poison slots.

    batch = StateBatch(model, capacities=[32, 32], block_size=4, slots=[3, 0])
    first = batch.step([[1, 2, 3], [4, 5]])       # per sequence [len(chunk), vocab] fp32
    nxt = batch.step([[7], [8]])
    batch.restart(0)                               # sequence 0 starts over (num_computed = 0), same slot
"""

from __future__ import annotations

import copy
import random
from typing import Any

import torch
from torch import nn

from attention_zoo import CacheLayer, CommonAttentionMetadata
from research_lm import LLM, SamplingParams


class StateBatch:
    def __init__(
        self, model: nn.Module, capacities: list[int], block_size: int, slots: list[int] | None = None,
        num_slots: int | None = None,
    ):
        self.model = model
        self.block_size = block_size
        self.capacities = list(capacities)
        self.slots = list(slots) if slots is not None else list(range(len(capacities)))
        self.layers = [m for m in model.modules() if isinstance(m, CacheLayer)]
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        blocks = [-(-c // block_size) for c in capacities]
        table = torch.zeros(len(capacities), max(blocks), dtype=torch.int32)
        start = 1
        for i, n in enumerate(blocks):
            table[i, :n] = torch.arange(start, start + n, dtype=torch.int32)
            start += n
        self.block_table = table.to(self.device)
        num_slots = num_slots or max(self.slots) + 1
        self.caches = [
            layer.backend.allocate_cache(layer.spec, num_blocks=start, block_size=block_size, num_slots=num_slots,
                                         dtype=self.dtype, device=self.device)
            for layer in self.layers
        ]
        self.num_computed = [0] * len(capacities)

    def restart(self, seq: int) -> None:
        self.num_computed[seq] = 0

    def prepare(self, chunks: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        ids, positions, slots, query_lens, seq_lens = [], [], [], [], []
        for i, chunk in enumerate(chunks):
            start = self.num_computed[i]
            assert start + len(chunk) <= self.capacities[i], f"sequence {i} exceeds its capacity"
            pos = list(range(start, start + len(chunk)))
            table = self.block_table[i].tolist()
            ids += chunk
            positions += pos
            slots += [table[p // self.block_size] * self.block_size + p % self.block_size for p in pos]
            query_lens.append(len(chunk))
            seq_lens.append(start + len(chunk))
        qsl = torch.zeros(len(chunks) + 1, dtype=torch.int32)
        qsl[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
        seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=qsl.to(self.device), query_start_loc_cpu=qsl,
            seq_lens=seq_lens_cpu.to(self.device), seq_lens_cpu=seq_lens_cpu,
            num_computed_tokens_cpu=torch.tensor(self.num_computed, dtype=torch.int32),
            block_table=self.block_table,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            request_rows=torch.tensor(self.slots, dtype=torch.int32, device=self.device),
            num_reqs=len(chunks), num_tokens=len(ids), max_query_len=max(query_lens),
            max_seq_len=max(seq_lens), block_size=self.block_size,
        )
        backends = {layer.backend.name: layer.backend for layer in self.layers}
        attn_metadata = {name: backend.build_metadata(common) for name, backend in backends.items()}
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        return input_ids, torch.tensor(positions, dtype=torch.int64, device=self.device), attn_metadata

    @torch.no_grad()
    def step(self, chunks: list[list[int]]) -> list[torch.Tensor]:  # per sequence [len(chunk_i), vocab] fp32
        for layer, cache in zip(self.layers, self.caches):
            layer.kv_cache = cache
        hidden = self.model(*self.prepare(chunks))
        for i, chunk in enumerate(chunks):
            self.num_computed[i] += len(chunk)
        return list(self.model.compute_logits(hidden).split([len(c) for c in chunks]))


def shared_prefix_prompts(seed: int = 0) -> list[list[int]]:
    """8 prompts of 3..39 tokens; the odd ones share a 9-token prefix."""
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(9)]
    prompts = []
    for i, n in enumerate([3, 5, 8, 13, 17, 21, 26, 30]):
        tail = [rng.randrange(256) for _ in range(n)]
        prompts.append(shared + tail if i % 2 else tail)
    return prompts


def hf_greedy(hf: nn.Module, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers.generate, greedy, exactly max_tokens each (no EOS, so no EOS masking either)."""
    config = copy.deepcopy(hf.generation_config)
    config.eos_token_id = None
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, do_sample=False,
                              max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=0)
        outs.append(gen[0, len(p):].tolist())
    return outs


def engine_greedy_matches_transformers(path, hf: nn.Module, max_tokens: int = 10, **knobs: Any) -> LLM:
    """Greedy through `LLM` under chunked prefill (16 tokens a step) and preemption (20 blocks of 4 for
    8 requests of up to 49 tokens) equals transformers.generate, token for token."""
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16, max_num_seqs=8,
              num_gpu_blocks=20, enable_prefix_caching=False, max_model_len=64, **knobs)
    prompts = shared_prefix_prompts()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    for out, want in zip(outs, hf_greedy(hf, prompts, max_tokens), strict=True):
        assert out.outputs[0].token_ids == want
        assert out.outputs[0].finish_reason == "length"
    assert llm.engine.scheduler.num_preemptions > 0, "the block budget should force preemption"
    return llm
