"""NgramProposer: longest suffix n-gram in [min, max], earliest earlier occurrence, up to k tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from research_lm.api.sampling_params import SamplingParams
from research_lm.engine.request import Request
from research_lm.worker.spec import StepOutcome, TokenTable
from spec_decode.ngram import NgramProposer, build_proposer


def naive_proposal(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        for s in range(length - n):  # earlier occurrences only, earliest first
            if tokens[s : s + n] == suffix:
                return tokens[s + n : s + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=0, max_size=40),
    min_n=st.integers(1, 4),
    extra=st.integers(0, 3),
    k=st.integers(0, 6),
)
def test_matches_naive_reference(tokens, min_n, extra, k):
    proposer = NgramProposer(min_n, min_n + extra, k)
    expected = naive_proposal(tokens, min_n, min_n + extra, k)
    assert proposer.propose([tokens]) == [expected]
    assert proposer.propose([np.array(tokens, dtype=np.int32)]) == [expected]


@settings(max_examples=200, deadline=None)
@given(
    batch=st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=30), min_size=1, max_size=6),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 3),
    k=st.integers(0, 5),
)
def test_a_batch_matches_the_reference_request_by_request(batch, min_n, extra, k):
    """All requests are searched at once over their sequences laid end to end: no match may cross from one
    request into the next."""
    want = [naive_proposal(tokens, min_n, min_n + extra, k) for tokens in batch]
    assert NgramProposer(min_n, min_n + extra, k).propose(batch) == want


def test_batch_mixes_lengths_and_types():
    proposer = NgramProposer(1, 3, 2)
    batch = [[1, 2, 3, 1, 2], np.array([5]), [], np.array([7, 8, 9, 7, 8, 9, 7])]
    assert proposer.propose(batch) == [[3, 1], [], [], [8, 9]]


def test_longest_ngram_wins_over_earlier_shorter_match():
    # Suffix [1, 2]: the 1-gram [2] first occurs at index 0 (followed by 9), but the 2-gram [1, 2]
    # occurs at index 3 (followed by 7); the longer match wins.
    tokens = [2, 9, 9, 1, 2, 7, 1, 2]
    assert NgramProposer(1, 2, 3).propose([tokens]) == [[7, 1, 2]]
    assert NgramProposer(1, 1, 3).propose([tokens]) == [[9, 9, 1]]


def test_earliest_occurrence_wins_ties():
    tokens = [4, 5, 10, 4, 5, 11, 4, 5]
    assert NgramProposer(2, 2, 2).propose([tokens]) == [[10, 4]]


def test_max_bound_caps_ngram_length():
    # Suffix [1, 2, 3] occurs fully at index 4 (-> 8); with max 2, the 2-gram [2, 3] first occurs at 1 (-> 7).
    tokens = [0, 2, 3, 7, 1, 2, 3, 8, 1, 2, 3]
    assert NgramProposer(1, 3, 1).propose([tokens]) == [[8]]
    assert NgramProposer(1, 2, 1).propose([tokens]) == [[7]]


def test_min_bound_rejects_short_matches():
    tokens = [1, 2, 3, 9, 3]  # only the 1-gram [3] repeats
    assert NgramProposer(1, 3, 2).propose([tokens]) == [[9, 3]]
    assert NgramProposer(2, 3, 2).propose([tokens]) == [[]]


def test_fewer_tokens_at_sequence_end_and_overlap():
    assert NgramProposer(2, 2, 5).propose([[6, 6, 6]]) == [[6]]  # occurrence at 0 overlaps the suffix
    assert NgramProposer(1, 3, 4).propose([[1, 2, 1]]) == [[2, 1]]


def test_no_match_gives_empty():
    assert NgramProposer(1, 4, 3).propose([[1, 2, 3, 4], [1], []]) == [[], [], []]


def test_zero_speculative_tokens():
    assert NgramProposer(1, 2, 0).propose([[1, 1, 1]]) == [[]]


@pytest.mark.parametrize("args", [(0, 2, 1), (3, 2, 1), (1, 2, -1)])
def test_invalid_config(args):
    with pytest.raises(ValueError):
        NgramProposer(*args)


def test_long_sequence_matches_reference():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, size=32_768)
    tokens[-5:] = tokens[100:105]
    out = NgramProposer(1, 5, 4).propose([tokens])[0]
    assert out == naive_proposal(tokens.tolist(), 1, 5, 4)


def test_step_proposer_drafts_from_the_device_table():
    """The runner's protocol: at launch, drafts continue each row's tokens in the device table (this step's emitted
    ones appended); a request that emitted nothing (mid-prefill) drafts nothing."""
    proposer = build_proposer({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}, None)
    assert (proposer.ngram.prompt_lookup_min, proposer.ngram.prompt_lookup_max) == (2, 2)
    assert proposer.num_speculative_tokens == 2 and proposer.aux_hidden_state_layers == ()
    a = Request("a", [1, 2, 3, 4, 1], SamplingParams(), seed=0)
    b = Request("b", [5, 6, 7, 5, 6, 7], SamplingParams(), seed=0)  # mid-prefill: emits nothing
    table = torch.zeros(4, 16, dtype=torch.int32)
    table[3, :6] = torch.tensor([1, 2, 3, 4, 1, 2])  # a's prompt and the token it emitted
    table[1, :6] = torch.tensor(b.prompt_token_ids)
    rows = torch.tensor([3, 1], dtype=torch.int32)
    outcome = StepOutcome(
        requests=[a, b], input_ids=torch.zeros(0, dtype=torch.int64), positions=torch.zeros(0, dtype=torch.int64),
        query_start_loc_cpu=torch.zeros(3, dtype=torch.int32), hidden_states=None, aux_hidden_states=None, common=None,
        tokens=TokenTable(table, torch.tensor([0, 6, 0, 6], dtype=torch.int32), rows),
        emitted_ids=torch.tensor([[2], [-1]]), num_emitted=torch.tensor([1, 0], dtype=torch.int32))
    drafts = proposer.propose_on_device(outcome)
    assert drafts.index == [0, 1] and drafts.num.tolist() == [2, 0] and drafts.token_ids[0].tolist() == [3, 4]
    proposer.on_requests_removed({"a"})
    default = build_proposer({"method": "ngram", "num_speculative_tokens": 3}, None).ngram
    assert (default.prompt_lookup_min, default.prompt_lookup_max) == (5, 5)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        build_proposer({"method": "ngram"}, None)
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 1, got 0"):
        build_proposer({"method": "ngram", "num_speculative_tokens": 0}, None)
