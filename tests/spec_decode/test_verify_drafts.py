"""Verification on the device: the argmax-only shortcut (`plain_greedy` per request, no sampling batch) decides exactly
when the full path would take argmax and emits what it emits; draft slots past a request's real drafts are never
accepted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from research_lm.api.outputs import ScheduledRequest
from research_lm.api.sampling_params import SamplingParams
from research_lm.engine.request import Request
from research_lm.worker.sampler import SamplingBatch, SamplingRow, plain_greedy
from research_lm.worker.verification import verify_drafts

VOCAB, K = 11, 3


def _step(params: list[SamplingParams], outputs: int = 2, seed: int = 0):
    """Each request verifies K drafts: its input is [last token, d_1 .. d_K]; the target agrees with request i's
    first i % (K + 1) drafts."""
    gen = torch.Generator().manual_seed(seed)
    scheduled, sample_rows, inputs, drafts = [], [], [], []
    for i, p in enumerate(params):
        req = Request(f"r{i}", [1, 2, 3], p, seed=i, eos_token_id=0)
        req.output_token_ids = [4] * outputs
        d = torch.randint(0, VOCAB, (K,), generator=gen).tolist()
        scheduled.append(ScheduledRequest(req, K + 1, [1], K))
        sample_rows += [(i, j) for j in range(K + 1)]
        inputs += [4, *d]
        drafts.append(d)
    logits = torch.randn(len(sample_rows), VOCAB, generator=gen)
    for r, (i, j) in enumerate(sample_rows):
        if j < i % (K + 1):
            logits[r, drafts[i][j]] = 10.0
    qsl = np.arange(0, len(inputs) + 1, K + 1)
    return scheduled, sample_rows, logits, torch.tensor(inputs), qsl, drafts


def _verify(scheduled, sample_rows, logits, inputs, qsl, drafts, batch, num_valid=None):
    n = len(scheduled)
    valid = torch.full((n,), K, dtype=torch.int32) if num_valid is None else torch.tensor(num_valid, dtype=torch.int32)
    emitted, count, real, _ = verify_drafts(scheduled, list(range(n)), qsl, logits, None, inputs, valid, batch, {})
    return [row[:c].tolist() for row, c in zip(emitted, count, strict=True)], real.tolist()


GREEDY = SamplingParams(temperature=0.0, max_tokens=50)


@pytest.mark.parametrize("other, shortcut", [
    (GREEDY, True),
    (SamplingParams(temperature=0.0, max_tokens=50, min_tokens=2), True),  # min_tokens already reached
    (SamplingParams(temperature=0.0, max_tokens=50, min_tokens=3), False),  # rows below min_tokens: EOS banned
    (SamplingParams(temperature=0.0, max_tokens=50, logprobs=1), False),
    (SamplingParams(temperature=0.0, max_tokens=50, repetition_penalty=1.2), False),
    (SamplingParams(temperature=0.0, max_tokens=50, logit_bias={3: 1.0}), False),
    (SamplingParams(temperature=0.0, max_tokens=50, allowed_token_ids=[1, 2]), False),
    (SamplingParams(temperature=1.0, seed=3, max_tokens=50), False),
])
def test_the_shortcut_agrees_with_the_sampling_batch_and_the_full_path(other, shortcut):
    scheduled, sample_rows, logits, inputs, qsl, drafts = _step([GREEDY, other, GREEDY, GREEDY])
    assert all(plain_greedy(s.request) and s.request.sampling_params.logprobs is None for s in scheduled) is shortcut
    rows = [SamplingRow(scheduled[i].request, then=drafts[i][:j]) for i, j in sample_rows]
    batch = SamplingBatch.build(rows, VOCAB, "cpu")
    assert batch.argmax_only is shortcut
    got = _verify(scheduled, sample_rows, logits, inputs, qsl, drafts, None if shortcut else batch)
    want = _verify(scheduled, sample_rows, logits, inputs, qsl, drafts, batch)
    assert got == want
    if shortcut:
        assert [len(e) for e in got[0]] == [1, 2, 3, 4]  # accepted up to the agreeing drafts, then the target's


@pytest.mark.parametrize("full_path", [False, True])
def test_slots_past_the_real_drafts_are_never_accepted(full_path):
    """An n-gram lookup on the device may fill fewer slots than it was scheduled: request 3 agrees on all K drafts,
    but with 1 real one it emits 2 tokens (that draft, then the target's token at the next row)."""
    scheduled, sample_rows, logits, inputs, qsl, drafts = _step([GREEDY] * 4)
    rows = [SamplingRow(scheduled[i].request, then=drafts[i][:j]) for i, j in sample_rows]
    batch = SamplingBatch.build(rows, VOCAB, "cpu") if full_path else None
    emitted, real = _verify(scheduled, sample_rows, logits, inputs, qsl, drafts, batch, num_valid=[3, 0, 2, 1])
    assert [len(e) for e in emitted] == [1, 1, 3, 2] and real == [3, 0, 2, 1]
    assert emitted[3] == [drafts[3][0], int(logits[3 * (K + 1) + 1].argmax())]
