"""The uniform graph step's input kernel equals `graph_step_inputs_ref`, buffer for buffer: tokens staged as values
or as device indices (placeholders), starts crossing block boundaries, padded request rows, q = 1 and q > 1.

Runs under the Triton interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA), on the GPU
with CUDA.
"""

from __future__ import annotations

import pytest
import torch

from research_lm.ops.graph_step_inputs import graph_step_inputs
from research_lm.ops.reference import graph_step_inputs_ref
from tests.ops.cases import device

BS = 4


def _case(n: int, b: int, q: int, held: int, gen: torch.Generator):
    """Staging for n requests of q tokens (the last `held` of each on the device) padded to b; source; table."""
    source = torch.randint(0, 1000, (64,), generator=gen)
    staging = torch.zeros(b * q + 3 * b + 1, dtype=torch.int64)
    for i in range(n):
        values = torch.randint(0, 1000, (q,), generator=gen)
        if held:
            values[q - held :] = -1 - torch.randperm(64, generator=gen)[:held]
        staging[i * q : (i + 1) * q] = values
    staging[b * q : b * q + n] = torch.randint(0, 20, (n,), generator=gen)  # starts: q tokens cross blocks
    staging[b * q + b : b * q + b + n] = torch.randperm(8, generator=gen)[:n]  # request rows
    staging[b * q + b + n : b * q + 2 * b] = -1
    staging[b * q + 2 * b] = n
    staging[b * q + 2 * b + 1 : b * q + 3 * b + 1] = torch.randint(-1, 8, (b,), generator=gen)  # shift indices
    block_table = torch.randint(1, 50, (8, 8), generator=gen, dtype=torch.int32)
    return staging, (source if held else None), block_table


def _buffers(b: int, q: int) -> list[torch.Tensor]:  # stale values everywhere: every row must be written
    return [torch.full((b * q,), 77, dtype=torch.int64, device=device()) for _ in range(3)] + [
        torch.full((n,), 77, dtype=torch.int32, device=device()) for n in (b, b + 1, b)]


CASES = [(1, 1, 1, 0, False), (1, 1, 1, 1, False), (3, 4, 4, 3, False), (2, 8, 6, 5, False), (4, 4, 2, 0, False),
         (1, 1, 6, 6, True), (3, 4, 4, 4, True)]


@pytest.mark.parametrize("n, b, q, held, shifted", CASES)
def test_graph_step_inputs_matches_reference(n, b, q, held, shifted):
    gen = torch.Generator().manual_seed(n * 100 + b * 10 + q + held)
    staging, source, block_table = _case(n, b, q, held, gen)
    dev = device()
    staging, block_table = staging.to(dev), block_table.to(dev)
    source = source.to(dev) if source is not None else None
    shift = -torch.randint(0, 4, (8,), generator=gen).to(dev) if shifted else None  # starts move down by <= 3
    staging[b * q : b * q + n] += 3
    want, got = _buffers(b, q), _buffers(b, q)
    graph_step_inputs_ref(staging, source, block_table, *want, b=b, q=q, block_size=BS, shift=shift)
    graph_step_inputs(staging, source, block_table, *got, b=b, q=q, block_size=BS, shift=shift)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w), (g, w)
    ids, positions, slots, seq_lens, qsl, rows = (x.cpu() for x in want)  # the reference, spelled out once
    t = n * q
    assert (ids[t:] == 0).all() and (positions[t:] == 0).all() and (slots[t:] == -1).all()
    assert seq_lens[n:].tolist() == [0] * (b - n) and rows[n:].tolist() == [-1] * (b - n)
    assert qsl.tolist() == [min(i, n) * q for i in range(b + 1)]
    starts = staging[b * q : b * q + n].cpu()
    if shifted:
        at = staging[b * q + 2 * b + 1 : b * q + 2 * b + 1 + n].cpu()
        starts = starts + torch.where(at >= 0, shift.cpu()[at.clamp(min=0)], 0)
    assert positions[:t].tolist() == [s + j for s in starts.tolist() for j in range(q)]
    assert seq_lens[:n].tolist() == (starts + q).tolist()
    if held:
        values = staging[:t].cpu()
        assert ids[:t][values < 0].tolist() == source.cpu()[-1 - values[values < 0]].tolist()


def test_graph_step_inputs_writer_replays_what_it_launched():
    """`GraphStepInputs` over step buffers: the same (b, q, source) five times with new staged values, n and source
    contents each time; on CUDA the third call on replays a captured graph, and every call must still write what the
    reference writes from that call's staging."""
    from research_lm.buffers import StepBuffers
    from research_lm.ops.graph_step_inputs import GraphStepInputs

    b, q = 4, 3
    buf = StepBuffers(max_num_tokens=32, max_num_reqs=8, max_blocks_per_req=8, device=device())
    writer = GraphStepInputs(buf, BS)
    source = torch.zeros(64, dtype=torch.int64, device=device())
    gen = torch.Generator().manual_seed(0)
    for n in (3, 1, 4, 2, 3):
        staging, src, block_table = _case(n, b, q, 2, gen)
        buf.staging.gpu[: len(staging)].copy_(staging)
        buf.block_table.gpu[:8].copy_(block_table)
        source.copy_(src)
        writer(source, b, q)
        want = _buffers(b, q)
        graph_step_inputs_ref(buf.staging.gpu, source, buf.block_table.gpu, *want, b=b, q=q, block_size=BS)
        got = [buf.input_ids.gpu[: b * q], buf.positions.gpu[: b * q], buf.slot_mapping.gpu[: b * q],
               buf.seq_lens.gpu[:b], buf.query_start_loc.gpu[: b + 1], buf.request_rows.gpu[:b]]
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w), (n, g, w)
    assert len(writer.graphs) == (1 if device().type == "cuda" else 0)
