"""verify_drafts' argmax-only shortcut (`plain_greedy` per request, no per-row sampling batch) decides exactly when
the full path would take argmax, and emits what the full path emits."""

from __future__ import annotations

import pytest
import torch

import research_lm.verification as verification
from research_lm.outputs import ScheduledRequest
from research_lm.request import Request
from research_lm.sampler import SamplingBatch, SamplingRow, plain_greedy
from research_lm.sampling_params import SamplingParams

VOCAB, K = 11, 3


def _step(params: list[SamplingParams], outputs: int = 2, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    scheduled, sample_rows = [], []
    for i, p in enumerate(params):
        req = Request(f"r{i}", [1, 2, 3], p, seed=i, eos_token_id=0)
        req.output_token_ids = [4] * outputs
        drafts = torch.randint(0, VOCAB, (K,), generator=gen).tolist()
        scheduled.append(ScheduledRequest(req, K + 1, [1], drafts))
        sample_rows += [(i, j) for j in range(K + 1)]
    logits = torch.randn(len(sample_rows), VOCAB, generator=gen)
    for r, (i, j) in enumerate(sample_rows):  # drafts the target agrees with, up to a per-request point
        if j < i % (K + 1):
            logits[r, scheduled[i].spec_token_ids[j]] = 10.0
    return scheduled, sample_rows, logits


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
def test_the_shortcut_agrees_with_the_sampling_batch_and_the_full_path(other, shortcut, monkeypatch):
    scheduled, sample_rows, logits = _step([GREEDY, other, GREEDY, GREEDY])
    assert all(plain_greedy(s.request) and s.request.sampling_params.logprobs is None for s in scheduled) is shortcut
    rows = [SamplingRow(scheduled[i].request, then=scheduled[i].spec_token_ids[:j]) for i, j in sample_rows]
    assert SamplingBatch.build(rows, VOCAB, "cpu").argmax_only is shortcut
    got = verification.verify_drafts(scheduled, sample_rows, logits, None, {}, VOCAB, torch.device("cpu"))
    monkeypatch.setattr(verification, "plain_greedy", lambda request: False)
    want = verification.verify_drafts(scheduled, sample_rows, logits, None, {}, VOCAB, torch.device("cpu"))
    assert got[0] == want[0] and got[1] == want[1]
    if shortcut:
        assert [len(e) for e in got[0]] == [1, 2, 3, 4]  # accepted up to the agreeing drafts, then the target's
