"""Acceptance replay's verify kernel (research_lm/ops/replay_accept.py) writes what its torch path writes
(`AcceptanceReplay.accept_greedily`: `counts`, then `replay_greedy`), bit for bit: replayed counts from traces and from
rates, capped by the real drafts, the correction that skips a rejected real draft (or the echoed token, where there is
one), ties and padding rows, and the forged argmax rows. Under the Triton interpreter on CPU with a tiny vocabulary
and the column block shrunk to 16, so each row scan spans several iterations."""

from __future__ import annotations

import pytest
import torch

import research_lm.ops
import research_lm.ops.replay_accept as kernel_mod
from research_lm.worker.acceptance_replay import AcceptanceReplay, load_profile

V, K, B, R = 37, 4, 5, 8
TRACES = [[[4, 4], [4, 0], [4, 2]], [[4, 1]], [[4, 3], [2, 2]]]


def _replay(traces: bool, echo: int = 0) -> AcceptanceReplay:
    profile = load_profile({"source": "test", "num_speculative_tokens": K, "per_position": [0.9, 0.7, 0.6, 0.5],
                            "traces": TRACES if traces else None})
    replay = AcceptanceReplay(profile, K, torch.device("cpu"), max_num_reqs=R, echo=echo)
    replay.seeds.copy_(torch.tensor([3, -7, 11, 2**62, 5, 0, 9, 1]))
    replay.trace_of.copy_(torch.tensor([0, 1, 2, 0, 1, 2, 0, 1]))
    replay.cursor.copy_(torch.tensor([0, 5, 1, 2, 0, 3, 7, 1]))
    return replay


def _step(gen: torch.Generator):
    """b = 5 requests (the last a padding row) of q = k + 1 rows, logits with ties at the top."""
    q, t = K + 1, B * K + B
    logits = torch.randint(0, 4, (t, V), generator=gen).float()  # few values: many exact ties
    input_ids = torch.randint(0, V, (t,), generator=gen)
    greedy = logits.argmax(dim=-1)
    input_ids.view(B, q)[:2, 1:3] = greedy.view(B, q)[:2, :2]  # some drafts the target agrees with
    rows = torch.tensor([2, 0, 7, 4, -1], dtype=torch.int32)
    num_drafts = torch.tensor([4, 2, 4, 0, 3, 1, 4, 4], dtype=torch.int32)
    num_tokens = torch.tensor([10, 31, 7, 100, 55, 3, 18, 64], dtype=torch.int32)
    token_ids = torch.randint(0, V, (R, 128), generator=gen, dtype=torch.int32)
    return num_tokens, token_ids, rows, num_drafts, input_ids, greedy, logits, q


@pytest.mark.parametrize("echo", [0, 40], ids=["argmax", "echo"])  # 40: rows 2 and 0 have too few tokens
@pytest.mark.parametrize("traces", [True, False], ids=["traces", "rates"])
@pytest.mark.parametrize("seed", range(3))
def test_the_kernel_writes_what_the_torch_path_writes(traces, seed, echo, monkeypatch):
    num_tokens, token_ids, rows, num_drafts, input_ids, greedy, logits, q = _step(torch.Generator().manual_seed(seed))
    out, launches = {}, []
    real = kernel_mod.replay_accept
    monkeypatch.setattr(kernel_mod, "replay_accept", lambda *a: launches.append(1) or real(*a))
    for fused in (False, True):
        monkeypatch.setattr(research_lm.ops, "FUSED_DEVICE_TYPES", ("cuda", "cpu") if fused else ("cuda",))
        monkeypatch.setattr(kernel_mod, "_MAX_BLOCK", 16)
        g, packed = greedy.clone(), torch.full((B * q + 2 * B,), -9, dtype=torch.int64)
        _replay(traces, echo).accept_greedily(num_tokens, token_ids, rows, num_drafts, input_ids, g, logits, packed, B,
                                              q)
        out[fused] = (g, packed)
    (g_ref, p_ref), (g, p) = out[False], out[True]
    assert launches == [1]  # the kernel ran once, for the fused pass only
    t = B * q
    assert torch.equal(p[: t + 2 * B], p_ref[: t + 2 * B]) and torch.equal(g, g_ref)
    n = p_ref[t : t + B] - 1
    assert (n <= p_ref[t + B : t + 2 * B]).all() and (n[:4] > 0).any()  # capped by the real drafts; some kept
    assert not torch.equal(g_ref, greedy)  # rows 0 .. n were forged
    last = p_ref[:t].view(B, q).gather(1, n[:, None])[:, 0]
    at = num_tokens[rows.long().clamp(min=0)] + n - echo
    echoed = token_ids[rows.long().clamp(min=0), at.clamp(min=0)].long()
    if echo:  # row n's token is the echoed one wherever the text reaches back that far
        assert torch.equal(last[at >= 0], echoed[at >= 0]) and (at < 0).any() and (at >= 0).any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("traces", [True, False], ids=["traces", "rates"])
def test_on_cuda_the_kernel_writes_what_the_torch_path_writes(traces, monkeypatch):
    """A real vocabulary (128256 columns, near-ties from bf16-rounded logits) on the GPU."""
    gen = torch.Generator().manual_seed(0)
    num_tokens, token_ids, rows, num_drafts, input_ids, _, _, q = _step(gen)
    logits = torch.randn(B * q, 128256, generator=gen).bfloat16().float()
    greedy = logits.argmax(dim=-1)
    cuda = [x.cuda() for x in (num_tokens, rows, num_drafts, input_ids, greedy, logits, token_ids)]
    replay = _replay(traces, echo=40)
    for name in ("seeds", "trace_of", "cursor", "rates", *(("traces", "trace_lens") if traces else ())):
        setattr(replay, name, getattr(replay, name).cuda())
    replay.device = torch.device("cuda")
    out = {}
    for fused in (False, True):
        monkeypatch.setattr(research_lm.ops, "FUSED_DEVICE_TYPES", ("cuda",) if fused else ())
        g, packed = cuda[4].clone(), torch.full((B * q + 2 * B,), -9, dtype=torch.int64, device="cuda")
        replay.accept_greedily(cuda[0], cuda[6], cuda[1], cuda[2], cuda[3], g, cuda[5], packed, B, q)
        out[fused] = (g.cpu(), packed.cpu())
    assert torch.equal(out[True][0], out[False][0]) and torch.equal(out[True][1], out[False][1])
