"""Mamba2ForCausalLM matches transformers (fp32, torch fallback path) through per-request state slots.

Oracle: transformers' model on the same tiny checkpoint, one sequence at a time. Ours: `load_model` +
the `mamba_torch_ref` backend, several sequences per forward in arbitrary state slots, prompts that
span several SSD chunks (chunk_size 8), chunked prefill and decode continuing from the saved state;
and the whole engine (`LLM`) under chunked prefill and preemption.
"""

from __future__ import annotations

import logging

import pytest
import torch

from attention_zoo.mamba import MambaMixer
from research_lm import LLM, SamplingParams
from research_lm.models import load_model
from tests.models.stateful import engine_greedy_matches_transformers, hf_greedy, shared_prefix_prompts
from tests.utils import PagedBatch

ATOL = 1e-4
NAME = "mamba2"


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _load(tiny_checkpoint, name: str = NAME, **extra):
    model, _ = load_model(tiny_checkpoint(name), device="cpu", dtype=torch.float32, attention_backend="torch_ref",
                          extra=extra)
    return model


@torch.no_grad()
def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:  # [len, vocab]
    return hf(torch.tensor([tokens])).logits[0].float()


def test_batched_prefill_matches_transformers(tiny_checkpoint, hf_model):
    """One forward over sequences of 1 to 33 tokens (up to 5 SSD chunks), in scattered state slots."""
    model = _load(tiny_checkpoint)
    seqs = [_tokens(n, seed) for seed, n in enumerate([19, 5, 33, 1])]
    ours = PagedBatch(model, [len(s) for s in seqs], block_size=4, slots=[5, 2, 0, 7]).step(seqs)
    for tokens, logits in zip(seqs, ours):
        torch.testing.assert_close(logits, _hf_logits(hf_model(NAME), tokens), atol=ATOL, rtol=0)


def test_chunked_prefill_and_decode_match_transformers(tiny_checkpoint, hf_model):
    """Sequences advance by uneven chunks (prefill pieces that cross SSD chunks, 1-token chunks, idle
    steps) in shared batches; each chunk's logits equal the full-sequence logits at its positions."""
    model = _load(tiny_checkpoint)
    seqs = [_tokens(26, 10), _tokens(12, 11), _tokens(10, 12)]
    schedule = [(7, 3, 1), (9, 4, 0), (1, 1, 5), (1, 0, 1), (1, 1, 1), (1, 1, 1), (6, 2, 1)]
    batch = PagedBatch(model, [len(s) for s in seqs], block_size=4, slots=[1, 3, 0])
    done = [0] * len(seqs)
    got: list[list[torch.Tensor]] = [[] for _ in seqs]
    for step in schedule:
        chunks = [seq[d:d + n] for seq, d, n in zip(seqs, done, step)]
        for i, logits in enumerate(batch.step(chunks)):
            got[i].append(logits)
        done = [d + n for d, n in zip(done, step)]
    assert done == [len(s) for s in seqs]
    for tokens, pieces in zip(seqs, got):
        torch.testing.assert_close(torch.cat(pieces), _hf_logits(hf_model(NAME), tokens), atol=ATOL, rtol=0)


def test_new_request_ignores_what_its_slot_holds(tiny_checkpoint, hf_model):
    """num_computed_tokens == 0 means zero state: a poisoned slot, and a slot a previous request left
    mid-sequence (preemption / reuse), need no reset."""
    model = _load(tiny_checkpoint)
    a, b = _tokens(11, 20), _tokens(14, 21)
    batch = PagedBatch(model, [max(len(a), len(b))], block_size=4, slots=[2], num_slots=4)
    for conv_state, ssm_state in batch.kv_caches:
        conv_state.fill_(1e4)
        ssm_state.fill_(float("nan"))
    first = batch.step([a[:6]])[0]
    torch.testing.assert_close(first, _hf_logits(hf_model(NAME), a)[:6], atol=ATOL, rtol=0)
    batch.restart(0)  # the slot now holds a's state after 6 tokens; b starts over in it
    got = [batch.step([b[:9]])[0], batch.step([b[9:10]])[0], batch.step([b[10:]])[0]]
    torch.testing.assert_close(torch.cat(got), _hf_logits(hf_model(NAME), b), atol=ATOL, rtol=0)


def test_state_layout_and_memory_accounting(tiny_checkpoint):
    model = _load(tiny_checkpoint)
    mixers = [m for m in model.modules() if isinstance(m, MambaMixer)]
    assert len(mixers) == 2
    spec = mixers[0].spec
    assert (spec.num_heads, spec.head_dim, spec.n_groups, spec.state_size, spec.conv_kernel) == (8, 16, 1, 16, 4)
    assert spec.conv_dim == 8 * 16 + 2 * 1 * 16 and spec.chunk_size == 8
    assert spec.page_size_bytes(4, torch.float32) == 0
    # conv: 3 past inputs of 160 channels in the model dtype; ssm: 8 x 16 x 16 in fp32
    assert spec.state_bytes_per_slot(torch.bfloat16) == 3 * 160 * 2 + 8 * 16 * 16 * 4
    conv, ssm = mixers[0].backend.allocate_cache(
        spec, num_blocks=0, block_size=4, num_slots=5, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert conv.shape == (5, 3, 160) and conv.dtype == torch.bfloat16
    assert ssm.shape == (5, 8, 16, 16) and ssm.dtype == torch.float32


def test_random_init_for_speed_runs(tiny_checkpoint):
    """`init_random_weights` (no checkpoint) gives the transformers init: stable decay, finite logits."""
    from research_lm.models.loader import init_random_weights

    model = _load(tiny_checkpoint)
    init_random_weights(model, seed=0)
    mixer = model.backbone.layers[0].mixer
    assert torch.equal(mixer.A_log, torch.log(torch.arange(1, 9, dtype=torch.float32)))
    dt = torch.nn.functional.softplus(mixer.dt_bias)
    assert bool(((dt > 0.9e-3) & (dt < 0.11)).all())
    logits = PagedBatch(model, [20], block_size=4).step([_tokens(20, 3)])[0]
    assert bool(torch.isfinite(logits).all())


# ---- the whole engine -----------------------------------------------------------------------------


def test_engine_greedy_matches_transformers_under_pressure(tiny_checkpoint, hf_model):
    engine_greedy_matches_transformers(tiny_checkpoint(NAME), hf_model(NAME))


def test_prefix_caching_is_turned_off_with_a_warning(tiny_checkpoint, hf_model, caplog):
    """A cached prefix restores KV blocks, not the recurrent state: the engine disables prefix caching
    (default on) and says so; shared-prefix prompts still generate exactly."""
    with caplog.at_level(logging.WARNING, logger="research_lm.engine.llm_engine"):
        llm = LLM(str(tiny_checkpoint(NAME)), dtype="float32", device="cpu", block_size=4)
    assert "prefix caching is disabled" in caplog.text and "Mamba" in caplog.text
    assert llm.engine.kv_cache.enable_prefix_caching is False
    prompts = shared_prefix_prompts(1)[1::2][:2]  # two prompts sharing 9 tokens (2 full blocks)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(hf_model(NAME), prompts, 4)
    assert all(o.metrics.num_cached_tokens == 0 for o in outs)


def test_speculative_decoding_is_refused(tiny_checkpoint):
    with pytest.raises(ValueError, match="speculative decoding is not supported for models with Mamba"):
        LLM(str(tiny_checkpoint(NAME)), dtype="float32", device="cpu", enable_prefix_caching=False,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})
