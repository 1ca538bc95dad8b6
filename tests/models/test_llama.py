"""The Llama family (Llama, Mistral, Qwen2, Qwen3) matches transformers' logits through paged attention.

Oracle: transformers' eager model on the same tiny checkpoint, one sequence at a time, fp32.
Ours: `load_model` + the torch_ref backend, many sequences per forward, KV in blocks of 4.
"""

from __future__ import annotations

import pytest
import torch

from attention_zoo import Attention
from research_lm.models import load_model
from research_lm.worker.taps import HiddenStateTaps
from tests.conftest import SLIDING_WINDOW
from tests.utils import PagedBatch, forward_prefill, greedy_decode

ATOL = 1e-4
PARITY_MODELS = [
    "llama", "llama-gqa1", "llama-mha", "llama-bias", "llama-tied", "llama-sharded", "llama-bin",
    "llama-rope-llama3", "llama-rope-yarn", "mistral", "qwen2", "qwen2-sliding", "qwen3", "qwen3-layer-types",
]


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _load(tiny_checkpoint, name: str):
    model, _ = load_model(tiny_checkpoint(name), device="cpu", dtype=torch.float32, attention_backend="torch_ref")
    return model


@torch.no_grad()
def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:  # [len, vocab]
    return hf(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("name", PARITY_MODELS)
def test_batched_prefill_matches_transformers(name, tiny_checkpoint, hf_model):
    """One forward over sequences of different lengths (longer than the sliding window, crossing blocks)."""
    model = _load(tiny_checkpoint, name)
    seqs = [_tokens(n, seed) for seed, n in enumerate([19, 5, 33, 1])]
    ours = forward_prefill(model, seqs, block_size=4)
    for tokens, logits in zip(seqs, ours):
        torch.testing.assert_close(logits, _hf_logits(hf_model(name), tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2-sliding", "qwen3-layer-types"])
def test_chunked_prefill_and_decode_match_transformers(name, tiny_checkpoint, hf_model):
    """Sequences advance by uneven chunks (prefill pieces, decode steps, idle steps) in shared batches;
    each chunk's logits equal the full-sequence logits at its positions."""
    model = _load(tiny_checkpoint, name)
    seqs = [_tokens(23, 10), _tokens(12, 11)]
    schedule = [(7, 3), (9, 4), (1, 1), (1, 0), (1, 1), (1, 1), (3, 2)]  # tokens per sequence per step
    batch = PagedBatch(model, [len(s) for s in seqs], block_size=4)
    done = [0, 0]
    got: list[list[torch.Tensor]] = [[], []]
    for step in schedule:
        chunks = [seq[d:d + n] for seq, d, n in zip(seqs, done, step)]
        for i, logits in enumerate(batch.step(chunks)):
            got[i].append(logits)
        done = [d + n for d, n in zip(done, step)]
    for tokens, pieces in zip(seqs, got):
        torch.testing.assert_close(torch.cat(pieces), _hf_logits(hf_model(name), tokens), atol=ATOL, rtol=0)


def test_greedy_decode_matches_transformers_generate(tiny_checkpoint, hf_model):
    model = _load(tiny_checkpoint, "mistral")
    prompts = [_tokens(6, 20), _tokens(11, 21)]
    ours = greedy_decode(model, prompts, max_new_tokens=8, block_size=4)
    hf = hf_model("mistral")
    for prompt, generated in zip(prompts, ours):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
        assert generated == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize(
    "name, windows",
    [
        ("llama", [None, None]),
        ("mistral", [SLIDING_WINDOW] * 2),
        ("qwen2", [None, None]),
        ("qwen2-sliding", [None, SLIDING_WINDOW, SLIDING_WINDOW]),  # layers >= max_window_layers=1
        ("qwen3-layer-types", [SLIDING_WINDOW, None]),
    ],
)
def test_attention_layers_carry_the_configured_window(name, windows, tiny_checkpoint):
    model = _load(tiny_checkpoint, name)
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    assert [layer.spec.sliding_window for layer in layers] == windows
    assert all(layer.spec.scale == pytest.approx(16**-0.5) for layer in layers)


def test_aux_hidden_states_are_the_residual_stream_entering_each_layer(tiny_checkpoint, hf_model):
    """EAGLE-3 taps: aux i == transformers' hidden_states[i] (the input of layer i); i == num_layers is the
    stream before the final norm."""
    name = "llama-gqa1"  # 3 layers
    model = _load(tiny_checkpoint, name)
    tokens = _tokens(13, 30)
    plain = PagedBatch(model, [len(tokens)], block_size=4).forward([tokens])
    taps = HiddenStateTaps(model, (2, 0, 3), max_num_tokens=64)  # hooks installed from outside the model
    hidden = PagedBatch(model, [len(tokens)], block_size=4).forward([tokens])
    aux = taps.values(len(tokens))
    taps.remove()
    torch.testing.assert_close(hidden, plain, atol=0, rtol=0)
    with torch.no_grad():
        ref = hf_model(name)(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    assert len(aux) == 3
    torch.testing.assert_close(aux[0], ref[2][0], atol=ATOL, rtol=0)
    torch.testing.assert_close(aux[1], ref[0][0], atol=ATOL, rtol=0)
    torch.testing.assert_close(model.model.norm(aux[2]), hidden, atol=ATOL, rtol=0)


def test_interface_the_runner_relies_on(tiny_checkpoint):
    model = _load(tiny_checkpoint, "llama-tied")
    assert model.get_input_embeddings() is model.embed_tokens
    assert model.lm_head.weight is model.embed_tokens.weight  # tied: one tensor
    batch = PagedBatch(model, [5], block_size=4)
    hidden = batch.forward([[1, 2, 3, 4, 5]])
    assert hidden.shape == (5, 64)
    logits = model.compute_logits(hidden)
    assert logits.shape == (5, 256) and logits.dtype == torch.float32


def test_inputs_embeds_replace_the_token_lookup(tiny_checkpoint):
    model = _load(tiny_checkpoint, "qwen3")
    tokens = _tokens(9, 40)
    expected = PagedBatch(model, [9], block_size=4).forward([tokens])
    batch = PagedBatch(model, [9], block_size=4)
    input_ids, positions, meta = batch.prepare([tokens])
    for layer, cache in zip(batch.layers, batch.kv_caches):
        layer.kv_cache = cache
    with torch.no_grad():
        got = model(torch.zeros_like(input_ids), positions, meta, inputs_embeds=model.embed_tokens(input_ids))
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_load_weights_reports_every_parameter(tiny_checkpoint):
    from research_lm.models.loader import checkpoint_files, iter_checkpoint

    model = _load(tiny_checkpoint, "qwen2")
    loaded = model.load_weights(iter_checkpoint(checkpoint_files(tiny_checkpoint("qwen2"))))
    assert loaded == {name for name, _ in model.named_parameters()}
    assert "model.layers.0.self_attn.qkv_proj.bias" in loaded
    assert "model.layers.0.mlp.gate_up_proj.weight" in loaded


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3", "mistral"])
def test_bf16_on_cuda_tracks_fp32(name, tiny_checkpoint):
    """Built directly on the GPU in bf16; logits stay within bf16 noise of the fp32 CPU model."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    path = tiny_checkpoint(name)
    model, _ = load_model(path, device="cuda", dtype=torch.bfloat16, attention_backend="torch_ref")
    assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16 for p in model.parameters())
    seqs = [_tokens(n, seed) for seed, n in enumerate([19, 33])]
    ref = forward_prefill(_load(tiny_checkpoint, name), seqs, block_size=4)
    for got, want in zip(forward_prefill(model, seqs, block_size=4), ref):
        assert got.device.type == "cuda"
        torch.testing.assert_close(got.cpu(), want, atol=0.15, rtol=0.05)
