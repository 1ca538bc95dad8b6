"""Bamba (Mamba2 + attention hybrid) matches transformers; each layer kind gets its own backend and cache.

Tiny checkpoint: Mamba2 mixers at layers 0 and 2, half-rotary GQA attention at layer 1 (paged KV,
`attention_backend`), SSD chunks of 8. Oracle: transformers' eager model, one sequence at a time.
"""

from __future__ import annotations

import pytest
import torch

from attention_zoo import Attention
from attention_zoo.mamba import MambaMixer
from research_lm.models import load_model
from research_lm.worker.runner import ModelRunner
from tests.models.stateful import engine_greedy_matches_transformers
from tests.utils import PagedBatch

ATOL = 1e-4
NAME = "bamba"


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _load(tiny_checkpoint, **kwargs):
    kwargs = {"attention_backend": "torch_ref"} | kwargs
    model, _ = load_model(tiny_checkpoint(NAME), device="cpu", dtype=torch.float32, **kwargs)
    return model


@torch.no_grad()
def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:  # [len, vocab]
    return hf(torch.tensor([tokens])).logits[0].float()


def test_batched_prefill_matches_transformers(tiny_checkpoint, hf_model):
    model = _load(tiny_checkpoint)
    seqs = [_tokens(n, seed) for seed, n in enumerate([19, 5, 33, 1])]
    ours = PagedBatch(model, [len(s) for s in seqs], block_size=4, slots=[3, 0, 6, 1]).step(seqs)
    for tokens, logits in zip(seqs, ours):
        torch.testing.assert_close(logits, _hf_logits(hf_model(NAME), tokens), atol=ATOL, rtol=0)


def test_chunked_prefill_and_decode_match_transformers(tiny_checkpoint, hf_model):
    """KV pages and state slots advance together by uneven chunks, idle steps included."""
    model = _load(tiny_checkpoint)
    seqs = [_tokens(23, 10), _tokens(12, 11)]
    schedule = [(7, 3), (9, 4), (1, 1), (1, 0), (1, 1), (1, 1), (3, 2)]
    batch = PagedBatch(model, [len(s) for s in seqs], block_size=4, slots=[2, 0])
    done = [0, 0]
    got: list[list[torch.Tensor]] = [[], []]
    for step in schedule:
        chunks = [seq[d:d + n] for seq, d, n in zip(seqs, done, step)]
        for i, logits in enumerate(batch.step(chunks)):
            got[i].append(logits)
        done = [d + n for d, n in zip(done, step)]
    for tokens, pieces in zip(seqs, got):
        torch.testing.assert_close(torch.cat(pieces), _hf_logits(hf_model(NAME), tokens), atol=ATOL, rtol=0)


def test_each_layer_kind_gets_its_backend_and_one_budget(tiny_checkpoint):
    model = _load(tiny_checkpoint, extra={"mamba_backend": "mamba_torch_ref"})
    kinds = [type(m) for m in model.modules() if isinstance(m, Attention | MambaMixer)]
    assert kinds == [MambaMixer, Attention, MambaMixer]
    attn = next(m for m in model.modules() if isinstance(m, Attention))
    mixer = next(m for m in model.modules() if isinstance(m, MambaMixer))
    assert (attn.backend.name, mixer.backend.name) == ("torch_ref", "mamba_torch_ref")
    runner = ModelRunner(model, device=torch.device("cpu"), block_size=4, max_num_seqs=3, max_num_batched_tokens=16,
                         max_model_len=32, vocab_size=256)
    assert runner.page_size_bytes(torch.float32) == 2 * 4 * 2 * 16 * 4  # K and V of the one attention layer
    assert runner.state_bytes(torch.float32) == 3 * 2 * mixer.spec.state_bytes_per_slot(torch.float32)
    runner.allocate_kv_cache(9, torch.float32)
    assert attn.kv_cache.shape == (2, 9, 4, 2, 16)
    assert [s.shape[0] for s in mixer.kv_cache] == [3, 3]  # one slot per request row


def test_a_backend_of_the_wrong_kind_fails_at_build_time(tiny_checkpoint):
    with pytest.raises(ValueError, match=r"'torch_ref' does not implement mamba layers.*mamba_torch_ref"):
        _load(tiny_checkpoint, extra={"mamba_backend": "torch_ref"})
    with pytest.raises(ValueError, match=r"'mamba_torch_ref' does not implement attention layers.*torch_ref"):
        _load(tiny_checkpoint, attention_backend="mamba_torch_ref")


def test_engine_greedy_matches_transformers_under_pressure(tiny_checkpoint, hf_model):
    engine_greedy_matches_transformers(tiny_checkpoint(NAME), hf_model(NAME))
