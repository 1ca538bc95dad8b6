"""The table-driven step kernels equal their torch references, and the references equal hand-computed numbers:
`gather_step_inputs` over mixed batches (a 37-token prompt chunk, decodes, a 4-token verify, padding requests and
tokens; a prompt spanning several token blocks; a padding tail longer than the grid covers), `advance_rows` and
`write_drafts` with skipped rows and rows at their width W, and `StepInputWriter` replaying what it launched.

Runs under the Triton interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA), on the GPU with CUDA.
"""

from __future__ import annotations

import pytest
import torch

from research_lm.ops.reference import advance_rows_ref, gather_step_inputs_ref, write_drafts_ref
from research_lm.ops.step_inputs import StepInputWriter, advance_rows, gather_step_inputs, write_drafts
from tests.ops.cases import device

BS = 4
R, W = 8, 400  # table rows, row width


def _tables(gen: torch.Generator, dev: torch.device, r: int = R, w: int = W):
    """Random token and block tables (the block table has r rows, so rows past a step's b hold garbage)."""
    token_ids = torch.randint(0, 1000, (r, w), generator=gen, dtype=torch.int32).to(dev)
    block_table = torch.randint(1, 500, (r, w // BS + 1), generator=gen, dtype=torch.int32).to(dev)
    return token_ids, block_table


def _step(queries: list[int], b: int, gen: torch.Generator, dev: torch.device, r: int = R, w: int = W):
    """Staging and num_computed for requests of these query lengths, on distinct random rows, padded to b."""
    n = len(queries)
    rows = torch.randperm(r, generator=gen)[:n]
    num_computed = torch.zeros(r, dtype=torch.int32)
    for row, q in zip(rows.tolist(), queries, strict=True):  # a random start that keeps the query inside w
        num_computed[row] = int(torch.randint(0, w - q + 1, (1,), generator=gen))
    qsl = torch.tensor([0, *queries]).cumsum(0)
    staging = torch.cat([rows, torch.full((b - n,), -1), qsl, qsl[-1].repeat(b - n)])
    return staging.to(dev), num_computed.to(dev)


def _outputs(b: int, t_pad: int, dev: torch.device) -> list[torch.Tensor]:
    """Step buffers longer than the step and full of stale values: the kernel must write every entry up to t_pad / b,
    and nothing past them."""
    return [torch.full((t_pad + 5,), 77, dtype=torch.int64, device=dev) for _ in range(3)] + [
        torch.full((m + 3,), 77, dtype=torch.int32, device=dev) for m in (b, b + 1, b)]


def _gather_both(token_ids, num_computed, block_table, staging, queries, b, t_pad, max_query_len=None):
    """(kernel's, reference's) outputs of one step."""
    want, got = _outputs(b, t_pad, staging.device), _outputs(b, t_pad, staging.device)
    args = (token_ids, num_computed, block_table, staging)
    kw = dict(b=b, t_pad=t_pad, max_query_len=max_query_len or max(queries), block_size=BS)
    gather_step_inputs_ref(*args, *want, **kw)
    gather_step_inputs(*args, *got, **kw)
    return got, want


GATHER_CASES = {  # queries, b, t_pad, max_query_len
    "mixed": ([37, 1, 1, 4], 6, 48, 37),
    "mixed, max_query_len overstated": ([37, 1, 1, 4], 6, 48, 600),
    "long prompt, two token blocks": ([300, 1], 2, 320, 300),
    "batch-1 decode": ([1], 1, 1, 1),
    "decode, long padding tail": ([1], 1, 40, 1),
    "verify": ([4, 4, 4], 4, 16, 4),
}


@pytest.mark.parametrize("queries, b, t_pad, max_query_len", GATHER_CASES.values(), ids=GATHER_CASES.keys())
def test_gather_step_inputs_matches_reference(queries, b, t_pad, max_query_len):
    gen = torch.Generator().manual_seed(sum(queries) + b + t_pad)
    dev = device()
    token_ids, block_table = _tables(gen, dev)
    staging, num_computed = _step(queries, b, gen, dev)
    got, want = _gather_both(token_ids, num_computed, block_table, staging, queries, b, t_pad, max_query_len)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w), (g, w)
    ids, positions, slots, seq_lens, qsl, rows = (x.cpu() for x in want)  # the reference, checked once more
    n, total, staging, num_computed = len(queries), sum(queries), staging.cpu(), num_computed.cpu()
    assert (ids[total:t_pad] == 0).all() and (positions[total:t_pad] == 0).all() and (slots[total:t_pad] == -1).all()
    assert (ids[t_pad:] == 77).all() and (seq_lens[b:] == 77).all() and (qsl[b + 1 :] == 77).all()
    assert rows[:b].tolist() == staging[:b].tolist() and seq_lens[n:b].tolist() == [0] * (b - n)
    assert qsl[: b + 1].tolist() == staging[b : 2 * b + 1].tolist()
    for i, q in enumerate(queries):
        start, row = int(qsl[i]), int(rows[i])
        assert positions[start : start + q].tolist() == list(range(num_computed[row], num_computed[row] + q))
        assert ids[start : start + q].tolist() == token_ids[row, positions[start : start + q]].tolist()
        assert seq_lens[i] == num_computed[row] + q


def test_gather_step_inputs_reference_by_hand():
    """Request 0: row 2, 3 tokens cached, 2 new (positions 3, 4: blocks 1 and 2); request 1: row 0, a 3-token prompt;
    one padding request and two padding tokens. Token ids are 100 * (row + 1) + column."""
    token_ids = (100 * torch.arange(1, 4)[:, None] + torch.arange(10)).to(torch.int32)  # [3, 10]
    num_computed = torch.tensor([0, 7, 3], dtype=torch.int32)
    block_table = torch.tensor([[7, 8, 9], [4, 5, 6], [1, 1, 1]], dtype=torch.int32)
    staging = torch.tensor([2, 0, -1, 0, 2, 5, 5])
    ids, positions, slots, seq_lens, qsl, rows = out = _outputs(3, 7, torch.device("cpu"))
    gather_step_inputs_ref(token_ids, num_computed, block_table, staging, *out, b=3, t_pad=7, max_query_len=3,
                           block_size=2)
    assert ids[:7].tolist() == [303, 304, 100, 101, 102, 0, 0]
    assert positions[:7].tolist() == [3, 4, 0, 1, 2, 0, 0]
    assert slots[:7].tolist() == [8 * 2 + 1, 9 * 2 + 0, 4 * 2 + 0, 4 * 2 + 1, 5 * 2 + 0, -1, -1]
    assert seq_lens[:3].tolist() == [5, 3, 0] and qsl[:4].tolist() == [0, 2, 5, 5] and rows[:3].tolist() == [2, 0, -1]


def _advance_case(dev: torch.device):
    """The hand case: W = 6; request 0 (row 1) emits 3 tokens from column 5 (only one fits), request 1 is skipped,
    request 2 (row 0) is a prompt chunk that emitted nothing, request 3 (row 2) emits one token."""
    t = dict(dtype=torch.int32, device=dev)
    tables = torch.zeros(3, 6, **t), torch.tensor([2, 5, 4], **t), torch.tensor([1, 3, 0], **t)
    step = (torch.tensor([1, -1, 0, 2], **t), torch.tensor([1, 9, 2, 4], device=dev),
            torch.tensor([[11, 12, 13], [21, 22, 23], [31, 32, 33], [41, 42, 43]], device=dev),
            torch.tensor([3, 2, 0, 1], **t))
    return tables, step


@pytest.mark.parametrize("fn", [advance_rows_ref, advance_rows], ids=["reference", "kernel"])
def test_advance_rows_by_hand(fn):
    (token_ids, num_tokens, num_computed), step = _advance_case(device())
    fn(token_ids, num_tokens, num_computed, *step)
    assert token_ids.tolist() == [[0] * 6, [0, 0, 0, 0, 0, 11], [0, 0, 0, 0, 41, 0]]
    assert num_tokens.tolist() == [2, 8, 5]
    assert num_computed.tolist() == [1 + 2, 3 + 1 + 2, 0 + 4]  # += delta + max(e - 1, 0)


@pytest.mark.parametrize("fn", [write_drafts_ref, write_drafts], ids=["reference", "kernel"])
def test_write_drafts_by_hand(fn):
    dev = device()
    token_ids = torch.zeros(3, 6, dtype=torch.int32, device=dev)
    num_tokens = torch.tensor([2, 5, 4], dtype=torch.int32, device=dev)
    fn(token_ids, num_tokens, torch.tensor([2, -1, 1], device=dev), torch.tensor([[7, 8], [9, 9], [5, 6]], device=dev))
    assert token_ids.tolist() == [[0] * 6, [0, 0, 0, 0, 0, 5], [0, 0, 0, 0, 7, 8]]  # row 1's second draft: past W
    assert num_tokens.tolist() == [2, 5, 4]


@pytest.mark.parametrize("fn", [write_drafts_ref, write_drafts], ids=["reference", "kernel"])
def test_one_draft_per_row_transposed_from_a_chain_buffer(fn):
    """k = 1 (MTP's one layer): the drafts arrive as a [1, n] chain buffer transposed, [n, 1] with column stride n,
    which `contiguous()` leaves as it is (session 31: the GPU capture of MTP's k = 1 graphs failed on it)."""
    dev = device()
    token_ids = torch.zeros(3, 6, dtype=torch.int32, device=dev)
    num_tokens = torch.tensor([2, 5, 4], dtype=torch.int32, device=dev)
    drafts = torch.tensor([[7, 9, 5]], device=dev).t().contiguous()
    assert drafts.stride() == (1, 3)
    fn(token_ids, num_tokens, torch.tensor([2, -1, 1], device=dev), drafts)
    assert token_ids.tolist() == [[0] * 6, [0, 0, 0, 0, 0, 5], [0, 0, 0, 0, 7, 0]]


def _rows_case(gen: torch.Generator, n: int, m: int, r: int = R, w: int = 12):
    """n requests on distinct random rows (every third skipped), rows filled up to near or at their width w."""
    rows = torch.randperm(r, generator=gen)[:n]
    rows[::3] = -1
    token_ids = torch.randint(0, 1000, (r, w), generator=gen, dtype=torch.int32)
    num_tokens = torch.randint(w - m - 1, w + 1, (r,), generator=gen, dtype=torch.int32)
    num_computed = num_tokens - torch.randint(1, 5, (r,), generator=gen, dtype=torch.int32)
    emitted = torch.randint(1000, 2000, (n, m), generator=gen)
    num_emitted = torch.randint(0, m + 1, (n,), generator=gen)
    delta = torch.randint(1, 40, (n,), generator=gen)
    return [x.to(device()) for x in (token_ids, num_tokens, num_computed, rows, delta, emitted, num_emitted)]


@pytest.mark.parametrize("n, m, rows_dtype", [(6, 4, torch.int64), (5, 1, torch.int32), (8, 6, torch.int32)])
def test_advance_rows_matches_reference(n, m, rows_dtype):
    token_ids, num_tokens, num_computed, rows, delta, emitted, num_emitted = _rows_case(
        torch.Generator().manual_seed(n * 10 + m), n, m)
    rows = rows.to(rows_dtype)
    want = [x.clone() for x in (token_ids, num_tokens, num_computed)]
    advance_rows_ref(*want, rows, delta, emitted, num_emitted)
    advance_rows(token_ids, num_tokens, num_computed, rows, delta, emitted, num_emitted)
    for g, w in zip((token_ids, num_tokens, num_computed), want, strict=True):
        assert torch.equal(g, w), (g, w)


@pytest.mark.parametrize("n, k", [(6, 3), (4, 1), (8, 7)])
def test_write_drafts_matches_reference(n, k):
    token_ids, num_tokens, _, rows, _, drafts, _ = _rows_case(torch.Generator().manual_seed(n * 10 + k), n, k)
    before, want = token_ids.clone(), token_ids.clone()
    write_drafts_ref(want, num_tokens, rows, drafts)
    write_drafts(token_ids, num_tokens, rows, drafts)
    assert torch.equal(token_ids, want) and not torch.equal(want, before)


def _writer_replays(dev: torch.device, steps: list[list[int]], b: int, t_pad: int) -> StepInputWriter:
    """A StepInputWriter over persistent tables and buffers, called once per step with that step's staging and table
    contents copied in (the buffers' addresses never change); each call must write what the reference writes."""
    t32, t64 = dict(dtype=torch.int32, device=dev), dict(dtype=torch.int64, device=dev)
    tables = [torch.zeros(R, W, **t32), torch.zeros(R, **t32), torch.zeros(R, W // BS + 1, **t32),
              torch.zeros(2 * R + 1, **t64)]
    outputs = [torch.zeros(64, **t64) for _ in range(3)] + [torch.zeros(m, **t32) for m in (R, R + 1, R)]
    addresses = [x.data_ptr() for x in tables + outputs]
    writer = StepInputWriter(*tables, *outputs, block_size=BS)
    gen = torch.Generator().manual_seed(0)
    for queries in steps:
        staging, num_computed = _step(queries, b, gen, dev)
        token_ids, block_table = _tables(gen, dev)
        for buf, value in zip(tables, (token_ids, num_computed, block_table, staging), strict=True):
            buf[: len(value)].copy_(value)
        writer(b, t_pad, max(queries))
        want = _outputs(b, t_pad, dev)
        gather_step_inputs_ref(*tables, *want, b=b, t_pad=t_pad, max_query_len=max(queries), block_size=BS)
        for g, w, size in zip(outputs, want, [t_pad] * 3 + [b, b + 1, b], strict=True):
            assert torch.equal(g[:size], w[:size]), (queries, g, w)
    assert [x.data_ptr() for x in tables + outputs] == addresses
    return writer


def test_step_input_writer_replays_what_it_launched():
    """The same key (b = 4, t_pad = 16, decode/verify grid) five times with new rows, starts, query lengths and
    table contents: on CUDA the second call captures and the third on replays one graph."""
    writer = _writer_replays(device(), [[4, 4, 4], [1, 4], [4, 4, 4, 4], [2], [3, 1, 4]], b=4, t_pad=16)
    assert len(writer.launches.graphs) == (1 if device().type == "cuda" else 0)


@pytest.mark.gpu
def test_step_kernels_on_cuda_at_real_shapes():
    """Batch-256 decode, a mixed batch with a 4000-token prompt chunk, and 64 verify rows of k = 5 over tables of 512
    rows of 8192 tokens, then 200 rows advanced: the kernels write the references' numbers; the writer captures one
    graph for a recurring key and replays it."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev, r, w = torch.device("cuda"), 512, 8192
    gen = torch.Generator().manual_seed(5)
    token_ids, block_table = _tables(gen, dev, r, w)
    for queries, b, t_pad in [([1] * 256, 256, 256), ([4000] + [1] * 63 + [6] * 30, 128, 4352), ([6] * 64, 64, 384)]:
        staging, num_computed = _step(queries, b, gen, dev, r, w)
        got, want = _gather_both(token_ids, num_computed, block_table, staging, queries, b, t_pad)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), queries
    args = _rows_case(gen, 200, 6, r, w)
    want = [x.clone() for x in args[:3]]
    advance_rows_ref(*want, *args[3:])
    advance_rows(*args)
    assert all(torch.equal(g, w) for g, w in zip(args[:3], want, strict=True))
    writer = _writer_replays(dev, [[1, 1, 1], [1], [1, 1], [1, 1, 1, 1], [1]], b=4, t_pad=4)
    assert len(writer.launches.graphs) == 1
