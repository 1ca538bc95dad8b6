"""Verification of a speculative step's drafts: the tokens each request emits, with their logprobs.

An all-greedy step without penalties, a min_tokens ban, logit_bias or allowed_token_ids needs each row's
argmax only (a decode graph's, when it has it): drafts are accepted while they equal it, then it is emitted.
Any other step goes through the rejection sampler (`research_lm.spec.load_rejection_sampler`, vLLM's [B, k+1]
rule) over the processed target distribution. Logprobs are the target's raw ones, from the row that emitted
each token, as plain sampling returns them.
"""

from __future__ import annotations

import torch

from research_lm.outputs import ScheduledRequest
from research_lm.request import Logprob
from research_lm.sampler import (
    SamplingBatch,
    SamplingRow,
    compute_probs,
    gather_logprobs,
    logprobs_to_dicts,
    plain_greedy,
)
from research_lm.spec import load_rejection_sampler


def verify_drafts(
    scheduled: list[ScheduledRequest],
    sample_rows: list[tuple[int, int]],  # (request index, draft offset j) per logits row
    logits: torch.Tensor,  # [num_sample_rows, vocab]
    greedy_ids: torch.Tensor | None,  # [num_sample_rows] logits.argmax(-1), when the graph computed it
    draft_probs: dict[str, torch.Tensor],  # request id -> [k, vocab] q of its drafts; verified ones are popped
    vocab_size: int,
    device: torch.device,
) -> tuple[list[list[int]], list[int], list[list[dict[int, Logprob]]] | None]:
    """Per scheduled request: the tokens it emits, how many drafts it rejected, and (where some request
    asks for logprobs) the emitted tokens' logprobs."""
    reqs = sorted({i for i, _ in sample_rows})
    batch = None
    if not all(plain_greedy(r) and r.sampling_params.logprobs is None for r in (scheduled[i].request for i in reqs)):
        rows = [SamplingRow(scheduled[i].request, then=scheduled[i].spec_token_ids[:j]) for i, j in sample_rows]
        batch = SamplingBatch.build(rows, vocab_size, device)
    drafts = [scheduled[i].spec_token_ids for i in reqs]
    q = [draft_probs.pop(scheduled[i].request.request_id, None) for i in reqs]
    emitted: list[list[int]] = [[] for _ in scheduled]
    if batch is None or batch.plain_argmax:
        target = (greedy_ids if greedy_ids is not None else logits.argmax(dim=-1)).tolist()
        row = 0
        for i, d in zip(reqs, drafts, strict=True):
            n = next((j for j, t in enumerate(d) if t != target[row + j]), len(d))  # drafts accepted
            emitted[i] = d[:n] + [target[row + n]]
            row += len(d) + 1
    else:
        q_cat = None
        if any(x is not None for x in q) and all(x is not None for x, d in zip(q, drafts) if d):
            q_cat = torch.cat([x[: len(d)] for x, d in zip(q, drafts) if d])
        tokens = load_rejection_sampler()(
            drafts, compute_probs(logits, batch), q_cat,
            torch.tensor([scheduled[i].request.sampling_params.greedy for i in reqs]),
            [scheduled[i].request.seed for i in reqs],
            [scheduled[i].request.num_output_tokens for i in reqs],
        ).tolist()
        for i, row in zip(reqs, tokens, strict=True):
            emitted[i] = [t for t in row if t != -1]
    num_rejected = [len(s.spec_token_ids) + 1 - len(e) if e else 0 for s, e in zip(scheduled, emitted)]
    logprobs = None if batch is None or batch.max_num_logprobs is None else _emitted_logprobs(
        logits, sample_rows, batch, emitted)
    return emitted, num_rejected, logprobs


def _emitted_logprobs(
    logits: torch.Tensor,  # [num_sample_rows, vocab] raw
    sample_rows: list[tuple[int, int]],
    batch: SamplingBatch,
    emitted: list[list[int]],
) -> list[list[dict[int, Logprob]]]:
    """Row (i, j) emitted token j of request i when the request emitted more than j tokens."""
    keep = [r for r, (i, j) in enumerate(sample_rows) if j < len(emitted[i])]
    ids = torch.tensor([emitted[i][j] for i, j in (sample_rows[r] for r in keep)], device=logits.device)
    rows = torch.tensor(keep, device=logits.device)
    tensors = gather_logprobs(torch.log_softmax(logits[rows].float(), dim=-1), ids, batch.max_num_logprobs)
    out: list[list[dict[int, Logprob]]] = [[] for _ in emitted]
    for r, d in zip(keep, logprobs_to_dicts(tensors, ids, [batch.num_logprobs[r] for r in keep]), strict=True):
        if d is not None:
            out[sample_rows[r][0]].append(d)
    return out
