"""What each request of a launched step emits, on the device: its sampled token, or the tokens its drafts' verification
keeps (research_lm/worker/verification.py). Nothing here waits for the device; the host reads the tokens at collect."""

from __future__ import annotations

from typing import NamedTuple

import torch

from research_lm.worker.acceptance_replay import AcceptanceReplay, StepReplay
from research_lm.worker.request_state import RequestState
from research_lm.worker.rng import to_device
from research_lm.worker.sampler import Sampler, SamplerOutput, SamplingBatch, SamplingRow, TokenHistory, plain_greedy
from research_lm.worker.step_inputs import StepInputs
from research_lm.worker.token_tree import DeviceTree
from research_lm.worker.verification import RequestTrees, verify_drafts


class StepTokens(NamedTuple):
    emitted: torch.Tensor  # [n, m] int64 per scheduled request (-1 after its tokens; none: a prompt chunk)
    num_emitted: torch.Tensor  # [n]
    num_real: torch.Tensor | None  # [n] int32: real drafts verified (a verify step)
    batch: SamplingBatch | None  # the sampling batch, where the step needed one (logprobs read it at collect)
    sampled: SamplerOutput | None  # a plain step's, for its logprobs
    packed: torch.Tensor  # [b * m] or [b * m + 2b] int64, what the host copies: b requests' emitted tokens, then
    # on a verify step their counts and real drafts (b: the step's n, or a verify graph's padded B)
    packed_rows: int  # that b
    path: torch.Tensor | None = None  # [n_s, m] a token tree's accepted path per sampling request (token_tree.py)


def sample_or_verify(inputs: StepInputs, scheduled, logits: torch.Tensor, greedy_ids: torch.Tensor | None,
                     input_ids: torch.Tensor, *, verifies: bool, state: RequestState, sampler: Sampler,
                     draft_probs: dict[str, torch.Tensor], vocab_size: int, accepted: torch.Tensor | None = None,
                     tree: DeviceTree | None = None, replay: AcceptanceReplay | None = None) -> StepTokens:
    """Sample each sampling request's next token, or verify its drafts (`verifies`). accepted: the verify graph's
    greedy acceptance (`GraphStep.accepted`), taken as it is where every request is a plain-greedy verify of the
    graph's q tokens (under acceptance `replay` the graph computed the replayed counts: `DecodeGraphs`)."""
    n, sampling, device = len(scheduled), inputs.sampling, logits.device
    if verifies and accepted is not None and _graph_accepts(inputs, scheduled):  # (replay too: the graph's counts)
        (b, q), t = inputs.graph_key, inputs.graph_key[0] * inputs.graph_key[1]
        if replay is not None:  # the graph read the traces' places: they move on
            replay.advance(inputs.rows[:n])
        return StepTokens(accepted[:t].view(b, q)[:n], accepted[t : t + n], accepted[t + b : t + b + n], None, None,
                          accepted, b)
    # Only some requests sample (others ran a prompt chunk): their rows among the step's, on the device.
    index = None if len(sampling) == n else to_device(sampling, torch.int64, device)
    batch = None
    if not verifies or not all(plain_greedy(s.request) and s.request.sampling_params.logprobs is None
                               for s in scheduled):
        batch = sampling_batch(inputs.sample_rows, scheduled, state, vocab_size, device)
    if not verifies:
        if greedy_ids is not None and batch.argmax_only:
            sampled = SamplerOutput(greedy_ids)  # what the sampler returns here, computed in the graph
        else:
            sampled = sampler(logits, batch)
        ids = sampled.token_ids
        if index is not None:
            ids = torch.zeros(n, dtype=torch.int64, device=device).index_copy_(0, index, ids)
        return StepTokens(ids[:, None], inputs.samples, None, batch, sampled, ids, n)
    table_rows = inputs.rows[:n] if index is None else inputs.rows[:n][index]
    emitted, num_emitted, num_real, path = verify_drafts(
        scheduled, sampling, inputs.common.query_start_loc_cpu.numpy(), logits, greedy_ids, input_ids,
        state.num_drafts[table_rows], batch, draft_probs,
        tree and RequestTrees(*tree.of_rows(table_rows.long()), max_depth=tree.depth),
        replay and StepReplay(replay, table_rows.long(), state.num_tokens[table_rows], state.token_ids))
    if index is not None:
        emitted = torch.full((n, emitted.shape[1]), -1, dtype=torch.int64, device=device).index_copy_(0, index, emitted)
        num_emitted = torch.zeros(n, dtype=torch.int32, device=device).index_copy_(0, index, num_emitted)
        num_real = torch.zeros(n, dtype=torch.int32, device=device).index_copy_(0, index, num_real)
    packed = torch.cat([emitted.view(-1), num_emitted.to(torch.int64), num_real.to(torch.int64)])
    return StepTokens(emitted, num_emitted, num_real, batch, None, packed, n, path)


def _graph_accepts(inputs: StepInputs, scheduled) -> bool:
    """Every request a plain-greedy verify of the graph's q tokens, without logprobs."""
    q = inputs.graph_key[1]
    return (len(inputs.sampling) == len(scheduled) and inputs.common.num_tokens == q * len(scheduled)
            and all(s.num_spec_tokens == q - 1 and plain_greedy(r := s.request) and r.sampling_params.logprobs is None
                    for s in scheduled))


def sampling_batch(sample_rows: list[tuple[int, int]], scheduled, state: RequestState, vocab_size: int,
                   device: torch.device) -> SamplingBatch:
    """The step's sampling batch; penalties read each row's history from the token table (row (i, j): request i's
    prompt and outputs, then its first j drafts)."""
    rows = [SamplingRow(scheduled[i].request, then=range(j)) for i, j in sample_rows]  # (j: only a count)
    history = None
    if any(r.request.sampling_params.penalized for r in rows):
        history = TokenHistory(state.token_ids, [state.rows.row_of[r.request.request_id] for r in rows],
                               [r.request.num_prompt_tokens for r in rows],
                               [r.request.num_tokens + len(r.then) for r in rows])
    return SamplingBatch.build(rows, vocab_size, device, history=history)
