"""The Leviathan check in spec runs: `leviathan_tau` from the measured per-draft acceptance `draft_alpha`."""

from __future__ import annotations

import random

import pytest

from research_lm.harness.experiment import AcceptanceMetrics, leviathan_tau


def test_formula():
    assert leviathan_tau(0.0, 5) == 1.0
    assert leviathan_tau(1.0, 3) == 4.0
    assert leviathan_tau(0.5, 1) == pytest.approx(1.5)
    assert leviathan_tau(0.8, 5) == pytest.approx(sum(0.8**i for i in range(6)))


def _summary(verifications: list[tuple[int, int]]) -> dict:
    """AcceptanceMetrics over verifications given as (drafts k, drafts accepted)."""
    metrics = AcceptanceMetrics()
    metrics.record_acceptance([k for k, _ in verifications], [[0] * (a + 1) for _, a in verifications])
    return metrics.summary()


@pytest.mark.parametrize("alpha", [0.3, 0.7, 0.9])
def test_iid_acceptance_matches_the_prediction(alpha):
    """Drafts accepted independently with probability alpha (k = 4, or 2 for a third of the requests): draft_alpha
    recovers alpha and the measured tau equals leviathan_tau, within sampling error over 20k verifications."""
    rng = random.Random(0)
    verifications = []
    for i in range(20_000):
        k = 2 if i % 3 == 0 else 4
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        verifications.append((k, accepted))
    s = _summary(verifications)
    assert s["draft_alpha"] == pytest.approx(alpha, abs=0.01)
    assert s["mean_acceptance_length"] == pytest.approx(s["leviathan_tau"], rel=0.01)


def test_position_dependent_acceptance_departs_from_the_prediction():
    """Position 1 always accepted, later drafts never: tau = 2 and alpha = 1/2, which i.i.d. acceptance would turn
    into 1.875 with k = 3."""
    s = _summary([(3, 1)] * 100)
    assert s["draft_alpha"] == pytest.approx(0.5) and s["mean_acceptance_length"] == pytest.approx(2.0)
    assert s["leviathan_tau"] == pytest.approx(1.875)


def test_all_accepted():
    s = _summary([(5, 5)] * 10)
    assert s["draft_alpha"] == 1.0 and s["leviathan_tau"] == s["mean_acceptance_length"] == 6.0


def test_emitted_per_forward_counts_the_steps_without_drafts_that_tau_leaves_out():
    """Two verify steps (3 drafts: 2 accepted, then 0) and two steps without drafts: tau = 1 + 2 / 2 = 2.0 over the
    verify steps, but 3 + 1 + 1 + 1 = 6 tokens over 4 forwards = 1.5 per forward."""
    metrics = AcceptanceMetrics()
    metrics.record_acceptance([3, 0], [[0, 0, 0], [0]])
    metrics.record_acceptance([3, 0], [[0], [0]])
    summary = metrics.summary()
    assert summary["mean_acceptance_length"] == 2.0
    assert summary["emitted_per_forward"] == 1.5
