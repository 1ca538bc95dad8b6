"""ngram_drafts: over the device token table, exactly `find_ngram_proposals`' drafts and counts, without a host sync.

Every CPU test runs twice: through the torch reference (`ngram_drafts_ref`) and through the Triton kernel
(spec_decode/ngram_kernel.py) under the interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA), with
"cpu" among the fused device types and the scan block shrunk to 16 positions, so most rows span several blocks.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import research_lm.ops
from spec_decode import ngram_kernel
from spec_decode.ngram import find_ngram_proposals
from spec_decode.ngram_device import ngram_drafts, ngram_drafts_ref

IMPLS = ["ref", "kernel"]


def lookup(impl: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """`ngram_drafts` through the reference, or through the kernel (counting its launches in `launched`)."""
    if impl == "ref":
        return ngram_drafts_ref

    def through_kernel(*args, **kwargs):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(research_lm.ops, "FUSED_DEVICE_TYPES", ("cuda", "cpu"))
            mp.setattr(ngram_kernel, "_BLOCK", 16)
            real = ngram_kernel.ngram_drafts_kernel
            mp.setattr(ngram_kernel, "ngram_drafts_kernel", lambda *a, **kw: launched.append(1) or real(*a, **kw))
            return ngram_drafts(*args, **kwargs)

    return through_kernel


launched: list[int] = []


def table_for(seqs, *, k, num_rows, vocab, rng, device="cpu", width=None):
    """A token table with `seqs` in shuffled rows among unused ones; every cell past a sequence (its draft slots,
    unused rows) holds random tokens of the same vocabulary, so reading past num_tokens would change the result."""
    width = width or max(map(len, seqs), default=0) + k + 1
    token_ids = rng.integers(0, vocab, size=(num_rows, width))
    num_tokens = rng.integers(0, width + 1, size=num_rows)
    rows = rng.permutation(num_rows)[: len(seqs)]
    for r, seq in zip(rows, seqs):
        token_ids[r, : len(seq)] = seq
        num_tokens[r] = len(seq)
    as_int32 = lambda a: torch.tensor(a, dtype=torch.int32, device=device)  # noqa: E731
    return as_int32(token_ids), as_int32(num_tokens), torch.tensor(rows, dtype=torch.int64, device=device)


def assert_same_as_host(seqs, *, min_n, max_n, k, rng, slack=0, num_rows=None, vocab=4, device="cpu", impl="ref"):
    token_ids, num_tokens, rows = table_for(
        seqs, k=k, num_rows=num_rows or len(seqs) + 3, vocab=vocab, rng=rng, device=device
    )
    max_len = max(map(len, seqs), default=0) + slack
    drafts, num_drafts = lookup(impl)(token_ids, num_tokens, rows, min_n=min_n, max_n=max_n, k=k, max_len=max_len)
    want = find_ngram_proposals([np.asarray(s, dtype=np.int64) for s in seqs], min_n, max_n, k)
    assert drafts.shape == (len(seqs), k) and drafts.dtype == torch.int64
    assert num_drafts.shape == (len(seqs),) and num_drafts.dtype == torch.int32
    assert num_drafts.tolist() == [len(w) for w in want]
    assert drafts.tolist() == [w + [0] * (k - len(w)) for w in want]
    return want


def planted(rng, length, vocab):
    """A random sequence whose tail repeats an earlier span, so long matches exist among many-token vocabularies."""
    seq = rng.integers(0, vocab, size=length)
    if length >= 4:
        n = int(rng.integers(1, length // 2 + 1))
        src = int(rng.integers(0, length - 2 * n + 1))
        seq[length - n :] = seq[src : src + n]
    return seq.tolist()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("min_n", "max_n", "k"), [(1, 1, 1), (1, 3, 4), (2, 2, 3), (2, 5, 5), (3, 8, 2), (5, 5, 7)])
@pytest.mark.parametrize("vocab", [3, 50])
def test_random_tables_match_the_host_rule(min_n, max_n, k, vocab, impl):
    """Lengths 0..80 (many shorter than min_n + 1), planted repeats, shuffled rows among unused ones, and a host
    bound above the true lengths."""
    rng = np.random.default_rng(min_n * 100 + max_n * 10 + k + vocab)
    # the interpreter runs one program at a time: the kernel gets one bound per case, tight or loose by vocabulary
    for slack in (0, 1, 17) if impl == "ref" else ({3: 0, 50: 17}[vocab],):
        seqs = [planted(rng, int(rng.integers(0, 81)), vocab) for _ in range(24)]
        assert_same_as_host(seqs, min_n=min_n, max_n=max_n, k=k, rng=rng, slack=slack, num_rows=40, vocab=vocab,
                            impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=150, deadline=None)
@given(
    batch=st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=30), min_size=1, max_size=6),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 4),
    k=st.integers(0, 5),
    slack=st.integers(0, 5),
    seed=st.integers(0, 2**16),
)
def test_any_batch_matches_the_host_rule(batch, min_n, extra, k, slack, seed, impl):
    assert_same_as_host(batch, min_n=min_n, max_n=min_n + extra, k=k, rng=np.random.default_rng(seed), slack=slack,
                        impl=impl)


@pytest.mark.parametrize("max_len", [9, 30, 64])
def test_kernel_equals_the_reference_on_every_row_of_a_random_table(max_len):
    """All rows, in random order and some twice, with random lengths up to the scanned width (or the whole table):
    the kernel's outputs are the reference's, element for element, and it ran once."""
    rng = np.random.default_rng(max_len)
    token_ids = torch.tensor(rng.integers(0, 3, size=(50, 40)), dtype=torch.int32)
    num_tokens = torch.tensor(rng.integers(0, min(max_len, 40) + 1, size=50), dtype=torch.int32)
    rows = torch.tensor(np.concatenate([rng.permutation(50), rng.integers(0, 50, size=10)]))
    kwargs = dict(min_n=2, max_n=6, k=4, max_len=max_len)
    launched.clear()
    got = lookup("kernel")(token_ids, num_tokens, rows, **kwargs)
    want = ngram_drafts_ref(token_ids, num_tokens, rows, **kwargs)
    assert launched == [1]
    assert [t.dtype for t in got] == [torch.int64, torch.int32]
    assert all(torch.equal(g, w) for g, w in zip(got, want)) and int(want[1].sum()) > 0


def test_cpu_tensors_take_the_reference_unless_cpu_is_a_fused_device(monkeypatch):
    monkeypatch.setattr(ngram_kernel, "ngram_drafts_kernel", lambda *a, **kw: pytest.fail("the kernel ran"))
    token_ids = torch.tensor([[1, 2, 1, 2]], dtype=torch.int32)
    drafts, num_drafts = ngram_drafts(token_ids, torch.tensor([4], dtype=torch.int32), torch.tensor([0]),
                                      min_n=1, max_n=2, k=3, max_len=4)
    assert num_drafts.tolist() == [2] and drafts.tolist() == [[1, 2, 0]]


@pytest.mark.parametrize("impl", IMPLS)
def test_hand_checked_cases(impl):
    """Longest wins over an earlier shorter match; earliest wins ties; a match near the end gives fewer than k;
    no match and too-short rows give none."""
    seqs = [
        [2, 9, 9, 1, 2, 7, 1, 2],  # suffix [1, 2] at 3 -> 7, 1, 2 (the 1-gram [2] at 0 would give 9, 9, 1)
        [4, 5, 10, 4, 5, 11, 4, 5],  # [4, 5] at 0 and 3: the earliest -> 10, 4, 5
        [6, 3, 6, 3],  # [6, 3] at 0 -> only 6, 3 follow before the end
        [1, 2, 3, 4],  # no earlier occurrence of any suffix
        [8],  # shorter than min_n + 1
        [],
    ]
    want = assert_same_as_host(seqs, min_n=1, max_n=2, k=3, rng=np.random.default_rng(0), slack=5, impl=impl)
    assert want == [[7, 1, 2], [10, 4, 5], [6, 3], [], [], []]


@pytest.mark.parametrize("impl", IMPLS)
def test_tokens_past_num_tokens_are_never_read(impl):
    """Row 0 has no match in its sequence, but its draft slots repeat its suffix: a reader that looked past
    num_tokens (here the host bound is the table width) would propose from them."""
    token_ids = torch.tensor([[7, 8, 9, 5, 6, 5, 6, 42, 43], [5, 6, 1, 5, 6, 0, 0, 0, 0]], dtype=torch.int32)
    num_tokens = torch.tensor([5, 5], dtype=torch.int32)
    drafts, num_drafts = lookup(impl)(token_ids, num_tokens, torch.tensor([0, 1]), min_n=2, max_n=2, k=3, max_len=9)
    assert num_drafts.tolist() == [0, 3] and drafts.tolist() == [[0, 0, 0], [1, 5, 6]]


@pytest.mark.parametrize("impl", IMPLS)
def test_host_bound_past_the_table_width_is_clamped(impl):
    token_ids = torch.tensor([[3, 1, 3, 1, 3]], dtype=torch.int32)
    args = (token_ids, torch.tensor([5], dtype=torch.int32), torch.tensor([0]))
    drafts, num_drafts = lookup(impl)(*args, min_n=1, max_n=3, k=2, max_len=1000)
    assert num_drafts.tolist() == [2] and drafts.tolist() == [[1, 3]]


@pytest.mark.parametrize("impl", IMPLS)
def test_shapes_without_any_possible_match(impl):
    token_ids = torch.zeros(4, 10, dtype=torch.int32)
    num_tokens = torch.full((4,), 2, dtype=torch.int32)
    for kwargs in (dict(k=0, max_len=10), dict(k=3, max_len=2), dict(k=3, max_len=10)):
        drafts, num_drafts = lookup(impl)(token_ids, num_tokens, torch.tensor([2, 0]), min_n=2, max_n=4, **kwargs)
        assert drafts.shape == (2, kwargs["k"]) and num_drafts.tolist() == [0, 0]
    drafts, num_drafts = lookup(impl)(
        token_ids, num_tokens, torch.tensor([], dtype=torch.int64), min_n=1, max_n=1, k=2, max_len=10
    )
    assert drafts.shape == (0, 2) and num_drafts.shape == (0,)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(min_n=0, max_n=2, k=1), "min_n"),
        (dict(min_n=3, max_n=2, k=1), "max_n"),
        (dict(min_n=1, max_n=2, k=-1), "k"),
    ],
)
def test_bad_bounds_name_the_field(kwargs, field, impl):
    token_ids = torch.zeros(1, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match=field):
        lookup(impl)(token_ids, torch.zeros(1, dtype=torch.int32), torch.tensor([0]), max_len=4, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("fn", [ngram_drafts, ngram_drafts_ref], ids=["kernel", "ref"])
def test_cuda_at_a_real_shape_matches_the_host_rule_without_a_host_sync(fn):
    """256 rows of up to 8192 tokens among 300, max_n = 8, k = 5: the host's drafts, no synchronizing call, and the
    temporaries within the module docstring's 10 bytes per (row, position) plus the outputs (the reference's bound;
    the kernel allocates only its outputs)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    rng = np.random.default_rng(22)
    seqs = [planted(rng, int(rng.integers(0, 8193)), 64) for _ in range(256)]
    seqs[0] = planted(rng, 8192, 64)
    token_ids, num_tokens, rows = table_for(seqs, k=5, num_rows=300, vocab=64, rng=rng, device="cuda")
    kwargs = dict(min_n=2, max_n=8, k=5, max_len=8192 + 3)
    fn(token_ids, num_tokens, rows, **kwargs)  # warm-up: lazy CUDA initialization (and the kernel's compile) may sync
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    torch.cuda.set_sync_debug_mode("error")
    try:
        drafts, num_drafts = fn(token_ids, num_tokens, rows, **kwargs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    peak = torch.cuda.max_memory_allocated() - before
    assert peak <= 10 * 256 * (8192 + 5) + (2 << 20), peak  # (bound's slack: outputs, [n]-sized and rounding)
    want = find_ngram_proposals([np.asarray(s, dtype=np.int64) for s in seqs], 2, 8, 5)
    assert num_drafts.tolist() == [len(w) for w in want]
    assert drafts.tolist() == [w + [0] * (5 - len(w)) for w in want]
    assert sum(map(len, want)) > 0
