"""The `mamba_torch_ref` mixer: chunked SSD == the recurrence, chunks across steps == one pass, and the
whole mixer (our `Mamba2Mixer` over state slots) == transformers' `Mamba2Mixer` torch path, outputs and
the conv / SSM states it leaves, for prefill, decode and mixed batches. fp32, CPU.
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import torch

from attention_zoo.mamba import (
    causal_conv1d_ref,
    selective_state_update_ref,
    ssd_chunk_scan_ref,
)
from research_lm.models.base import ModelBuildContext
from research_lm.models.mamba2 import Mamba2Mixer, Mamba2MixerConfig
from tests.attention_zoo.mamba_cases import make_mamba_case, mamba_common_metadata, run_mamba_backend

ATOL = 1e-5


def _ssm_inputs(n: int, H: int = 4, P: int = 8, N: int = 16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, P, generator=gen)
    dt = torch.nn.functional.softplus(torch.randn(n, H, generator=gen))
    A = -torch.exp(torch.randn(H, generator=gen) * 0.5)
    B, C = torch.randn(n, H, N, generator=gen), torch.randn(n, H, N, generator=gen)
    h0 = torch.randn(H, P, N, generator=gen)
    return x, dt, A, B, C, h0


@pytest.mark.parametrize("chunk_size", [1, 3, 8, 64])
def test_chunked_ssd_equals_the_recurrence(chunk_size):
    x, dt, A, B, C, h0 = _ssm_inputs(21)
    y, h = ssd_chunk_scan_ref(x, dt, A, B, C, chunk_size, h0)
    state, ys = h0, []
    for t in range(x.shape[0]):
        y_t, state = selective_state_update_ref(state, x[t], dt[t], A, B[t], C[t])
        ys.append(y_t)
    torch.testing.assert_close(y, torch.stack(ys), atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(h, state, atol=ATOL, rtol=ATOL)


def test_conv_state_carries_across_chunks():
    gen = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(11, 6, generator=gen), torch.randn(6, 4, generator=gen), torch.randn(6, generator=gen)
    full, _ = causal_conv1d_ref(x, torch.zeros(3, 6), w, b)
    expected = torch.nn.functional.conv1d(x.t()[None], w[:, None], b, padding=3, groups=6)[0, :, :11].t()
    torch.testing.assert_close(full, expected, atol=ATOL, rtol=0)
    state, pieces = torch.zeros(3, 6), []
    for a, z in [(0, 2), (2, 3), (3, 9), (9, 11)]:  # pieces shorter and longer than the state
        out, state = causal_conv1d_ref(x[a:z], state, w, b)
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces), full, atol=ATOL, rtol=0)
    torch.testing.assert_close(state, x[-3:], atol=0, rtol=0)


def test_steps_of_any_size_equal_one_pass():
    """A request split over steps (prefill chunks, single tokens) in its slot == the request in one step."""
    one = make_mamba_case([23], [False], [3], seed=2)
    y_one, (conv_one, ssm_one) = run_mamba_backend("mamba_torch_ref", one)
    cache = tuple(c.clone() for c in one.cache)
    done, pieces = 0, []
    for n in [7, 1, 9, 1, 5]:
        step = dataclasses.replace(one, xbc=one.xbc[done:done + n], dt=one.dt[done:done + n], cache=cache,
                                   common=mamba_common_metadata([n], [done], [3]))
        y, cache = run_mamba_backend("mamba_torch_ref", step)
        pieces.append(y)
        done += n
    torch.testing.assert_close(torch.cat(pieces), y_one, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(cache[0], conv_one, atol=ATOL, rtol=0)
    torch.testing.assert_close(cache[1], ssm_one, atol=ATOL, rtol=ATOL)


def test_new_requests_ignore_their_slot_and_other_slots_are_untouched():
    case = make_mamba_case([6, 1], [False, False], [4, 1], seed=3)
    y, (conv, ssm) = run_mamba_backend("mamba_torch_ref", case)
    zeroed = make_mamba_case([6, 1], [False, False], [4, 1], seed=3)
    for c in zeroed.cache:
        c[[4, 1]] = 0.0
    y0, _ = run_mamba_backend("mamba_torch_ref", zeroed)
    torch.testing.assert_close(y, y0, atol=0, rtol=0)
    others = [s for s in range(8) if s not in (4, 1)]
    assert torch.equal(conv[others], case.cache[0][others]) and torch.equal(ssm[others], case.cache[1][others])


# ---- against transformers' Mamba2Mixer -----------------------------------------------------------


def _hf_norms_per_group() -> bool:
    """transformers 5.2x normalizes the gated RMSNorm per B/C group, as mamba_ssm does; older versions
    (5.17 on the GPU machine) over the whole width, which equals it only for n_groups == 1."""
    from transformers.models.mamba2.modeling_mamba2 import MambaRMSNormGated

    return "group_size" in inspect.signature(MambaRMSNormGated.__init__).parameters


GROUPS = [1, pytest.param(2, marks=pytest.mark.skipif(
    not _hf_norms_per_group(), reason="this transformers normalizes the gated RMSNorm over all groups"))]


def _hf_and_ours(time_step_limit=(0.0, math.inf), n_groups=2):
    import transformers
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer as HFMamba2Mixer

    config = transformers.Mamba2Config(
        hidden_size=32, num_heads=4, head_dim=16, expand=2, n_groups=n_groups, state_size=16, conv_kernel=4,
        chunk_size=8, num_hidden_layers=1, vocab_size=16, time_step_limit=time_step_limit,
    )
    torch.manual_seed(0)
    hf = HFMamba2Mixer(config, layer_idx=0).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.2
            p.copy_(1.0 + noise if "norm" in name else noise)
    build = ModelBuildContext(torch.device("cpu"), torch.float32, "torch_ref", {"mamba_backend": "mamba_torch_ref"})
    ours = Mamba2Mixer(Mamba2MixerConfig.from_mamba2(config), build)
    ours.load_state_dict(hf.state_dict())
    ours.ssm.kv_cache = ours.ssm.backend.allocate_cache(
        ours.ssm.spec, num_blocks=0, block_size=16, num_slots=4, dtype=torch.float32, device=torch.device("cpu"))
    return config, hf, ours


def _run_ours(ours: Mamba2Mixer, hidden: torch.Tensor, query_lens, num_computed, slots) -> list[torch.Tensor]:
    md = ours.ssm.backend.build_metadata(mamba_common_metadata(query_lens, num_computed, slots))
    with torch.no_grad():
        return list(ours(hidden, {ours.ssm.backend.name: md}).split(query_lens))


@pytest.mark.parametrize("n_groups", GROUPS)
def test_mixer_matches_transformers_prefill_decode_and_states(n_groups):
    """Two sequences through one layer over 3 steps (prefill | prefill; decode + prefill chunk; decode |
    decode); outputs == transformers without cache, states == transformers' cache after the same tokens."""
    from transformers import DynamicCache

    config, hf, ours = _hf_and_ours(n_groups=n_groups)
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randn(12, 32, generator=gen), torch.randn(14, 32, generator=gen)]
    schedule = [(10, 7), (1, 6), (1, 1)]
    slots, done = [2, 0], [0, 0]
    got: list[list[torch.Tensor]] = [[], []]
    for step in schedule:
        hidden = torch.cat([s[d:d + n] for s, d, n in zip(seqs, done, step)])
        for i, y in enumerate(_run_ours(ours, hidden, list(step), done, slots)):
            got[i].append(y)
        done = [d + n for d, n in zip(done, step)]
    conv_state, ssm_state = ours.ssm.kv_cache
    for i, seq in enumerate(seqs):
        cache = DynamicCache(config=config)
        with torch.no_grad():
            expected = hf(seq[None])[0]
            hf(seq[None], cache_params=cache)
        torch.testing.assert_close(torch.cat(got[i]), expected, atol=ATOL, rtol=ATOL)
        hf_conv = cache.layers[0].conv_states[0][0]  # [conv_dim, conv_kernel]: the last conv_kernel inputs
        torch.testing.assert_close(conv_state[slots[i]], hf_conv[:, 1:].t(), atol=ATOL, rtol=0)
        hf_ssm = cache.layers[0].recurrent_states[0][0]  # [heads, head_dim, state]
        torch.testing.assert_close(ssm_state[slots[i]], hf_ssm, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("n_groups", GROUPS)
def test_mixer_decode_matches_transformers_recurrent_step(n_groups):
    """transformers' single-token path (causal_conv1d_update + selective_state_update) after a prefill."""
    from transformers import DynamicCache

    config, hf, ours = _hf_and_ours(n_groups=n_groups)
    seq = torch.randn(9, 32, generator=torch.Generator().manual_seed(6))
    cache = DynamicCache(config=config)
    expected = []
    with torch.no_grad():
        expected.append(hf(seq[None, :6], cache_params=cache)[0])
        for t in range(6, 9):
            expected.append(hf(seq[None, t:t + 1], cache_params=cache)[0])
    got = _run_ours(ours, seq[:6], [6], [0], [3])
    for t in range(6, 9):
        got += _run_ours(ours, seq[t:t + 1], [1], [t], [3])
    torch.testing.assert_close(torch.cat(got), torch.cat(expected), atol=ATOL, rtol=ATOL)


def test_time_step_limit_clamps_dt_like_transformers():
    """transformers clamps dt to time_step_limit in its chunked path; so do we (in every path)."""
    config, hf, ours = _hf_and_ours(time_step_limit=(0.2, 0.6), n_groups=1)
    seq = torch.randn(13, 32, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = hf(seq[None])[0]
    torch.testing.assert_close(_run_ours(ours, seq, [13], [0], [1])[0], expected, atol=ATOL, rtol=ATOL)
    _, _, unclamped = _hf_and_ours(n_groups=1)
    assert not torch.allclose(_run_ours(unclamped, seq, [13], [0], [1])[0], expected, atol=1e-3)
