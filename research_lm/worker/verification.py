"""Verification of a speculative step's drafts, on the device: what each request emits, without a host sync.

The drafts are the step's own input ids (each verifying request's last tokens), and how many of a request's draft
slots hold real drafts is in the device table (`num_valid`: an n-gram lookup on the device may fill fewer than it
was given). An all-greedy step without penalties, a min_tokens ban, logit_bias or allowed_token_ids needs each row's
argmax only (a decode graph's, when it has it): drafts are accepted while they equal it, then it is emitted. Any
other step goes through the rejection sampler (`research_lm.worker.rejection_sampler`, vLLM's [B, k+1] rule) over the
processed target distribution. Logprobs, where asked, are the target's raw ones, from the row that emitted each
token, as plain sampling returns them; they are read at collect, once the host knows what was emitted.
Under acceptance replay (research_lm/worker/acceptance_replay.py) a chain's verification runs, then each request keeps
the number of drafts its profile replays instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from research_lm.api.outputs import ScheduledRequest
from research_lm.engine.request import Logprob
from research_lm.worker.acceptance_replay import StepReplay, forge_argmax
from research_lm.worker.rejection_sampler import rejection_sample
from research_lm.worker.rng import to_device
from research_lm.worker.sampler import SamplingBatch, compute_probs, gather_logprobs, logprobs_to_dicts
from research_lm.worker.tree_verification import accept_tree_greedily, tree_rejection_sample


@dataclass(frozen=True)
class RequestTrees:
    """The sampling requests' token trees: parents, depths and ancestor masks [n, N + 1] int64
    (`DeviceTree.of_rows`), and the depth none exceeds (the outputs' width, less one)."""

    parents: torch.Tensor
    depths: torch.Tensor
    bits: torch.Tensor
    max_depth: int


def verify_drafts(
    scheduled: list[ScheduledRequest],
    sampling: list[int],  # the requests that sample, in batch order
    query_start_loc: np.ndarray,  # [num_reqs + 1] host
    logits: torch.Tensor,  # [num_sample_rows, vocab]: request sampling[i]'s d_i + 1 rows, in order
    greedy_ids: torch.Tensor | None,  # [num_sample_rows] logits.argmax(-1), when the graph computed it
    input_ids: torch.Tensor,  # [num_tokens] the step's input ids on the device
    num_valid: torch.Tensor,  # [len(sampling)] int32 on the device: real drafts among each one's slots
    batch: SamplingBatch | None,  # None: every row plain greedy
    draft_probs: dict[str, torch.Tensor],  # request id -> [k, vocab] q of its drafts; verified ones are popped
    tree: RequestTrees | None = None,  # the drafts are token trees' nodes 1..N (research_lm/worker/token_tree.py)
    replay: StepReplay | None = None,  # acceptance replay (chains only): the counts come from its profile
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per sampling request: emitted tokens [n_s, m] int64 (-1 after the emitted ones), how many [n_s] int32, its
    real drafts verified [n_s] int32, and with a tree the accepted path [n_s, m] (node indices, -1 after), all on
    the device. With `replay`, the replayed tokens and counts (`StepReplay.apply`); a uniform step's greedy_ids
    then hold them too (`forge_argmax`)."""
    device = input_ids.device
    reqs = [scheduled[i] for i in sampling]
    n = len(reqs)
    d = np.fromiter((s.num_spec_tokens for s in reqs), dtype=np.int64, count=n)
    k_max = int(d.max(initial=0))
    target_row_t = None  # None: logits row r*(k+1) + j is request r's row j (a uniform step)
    if n == len(scheduled) and len(input_ids) == n * (k_max + 1) and (d == k_max).all():
        # Every request runs its newest token and k drafts (a verify graph's step): views, no index to upload.
        drafts = input_ids.view(n, k_max + 1)[:, 1:]
        num_real = num_valid.to(torch.int32)  # (never above the k slots the drafter filled)
    else:
        j = np.arange(k_max)[None, :]
        first_row = np.cumsum(d + 1) - (d + 1)  # each request's first logits row
        ends = query_start_loc[1:][sampling][:, None]  # draft j of a request is its token ends - d + j
        draft_token = ends - np.maximum(d, 1)[:, None] + np.minimum(j, np.maximum(d[:, None] - 1, 0))  # in range
        target_row = first_row[:, None] + np.minimum(np.arange(k_max + 1)[None, :], d[:, None])
        host = np.concatenate([draft_token.reshape(-1), target_row.reshape(-1), d])
        up = to_device(torch.from_numpy(host), torch.int64, device)
        draft_token_t, target_row_t, d_t = up.split([n * k_max, n * (k_max + 1), n])
        drafts = input_ids[draft_token_t].view(n, k_max)
        num_real = torch.minimum(num_valid.to(torch.int64), d_t).to(torch.int32)
    q = [draft_probs.pop(s.request.request_id, None) for s in reqs]
    if tree is not None:
        assert replay is None, "acceptance replay verifies chains only (the engine refuses a tree)"
        return _verify_tree(tree, drafts, logits, greedy_ids, target_row_t, num_real, batch, reqs)
    emitted, num_emitted = _verify_chain(reqs, d, drafts, logits, greedy_ids, target_row_t, num_real, batch, q)
    if replay is not None:
        target_row = None if target_row_t is None else target_row_t.view(n, k_max + 1)
        emitted, num_emitted, count = replay.apply(d.tolist(), drafts, num_real, emitted, num_emitted, logits,
                                                   target_row)
        if greedy_ids is not None and target_row is None:
            forge_argmax(greedy_ids, emitted, count)
    return emitted, num_emitted, num_real, None


def _verify_chain(reqs: list[ScheduledRequest], d: np.ndarray, drafts: torch.Tensor, logits: torch.Tensor,
                  greedy_ids: torch.Tensor | None, target_row: torch.Tensor | None, num_real: torch.Tensor,
                  batch: SamplingBatch | None, q: list[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance, or the rejection sampler: emitted [n, k + 1] int64 (-1 after), how many [n] int32."""
    n, k_max = drafts.shape
    if batch is None or batch.plain_argmax:
        target = greedy_ids if greedy_ids is not None else logits.argmax(dim=-1)
        target = (target if target_row is None else target[target_row]).view(n, k_max + 1)
        emitted, n_acc = accept_greedily(drafts, target, num_real)
        return emitted, (n_acc + 1).to(torch.int32)
    q_cat = None
    if any(x is not None for x in q) and all(x is not None for x, c in zip(q, d) if c):
        q_cat = torch.cat([x[:c] for x, c in zip(q, d) if c])
    emitted = rejection_sample(
        drafts.contiguous(), compute_probs(logits, batch), q_cat, [s.request.sampling_params.greedy for s in reqs],
        [s.request.seed for s in reqs], [s.request.num_output_tokens for s in reqs], num_drafts=d.tolist(),
        num_valid=num_real)
    return emitted, (emitted >= 0).sum(dim=1).to(torch.int32)


def _verify_tree(tree: RequestTrees, drafts: torch.Tensor, logits: torch.Tensor, greedy_ids: torch.Tensor | None,
                 target_row: torch.Tensor | None, num_real: torch.Tensor, batch: SamplingBatch | None,
                 reqs: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chain's layout read as a tree's (slot j = node j + 1; a request given fewer slots has the first nodes,
    its others unreal): greedy longest path, or the multi-draft rejection rule (worker/tree_verification.py)."""
    n, k = drafts.shape
    nodes = torch.cat([drafts.new_zeros(n, 1), drafts], dim=1)  # node 0, the root, is no draft
    parents, depths, bits = tree.parents[:, : k + 1], tree.depths[:, : k + 1], tree.bits[:, : k + 1]
    if batch is None or batch.plain_argmax:
        target = greedy_ids if greedy_ids is not None else logits.argmax(dim=-1)
        target = (target if target_row is None else target[target_row]).view(n, k + 1)
        emitted, num_emitted, path = accept_tree_greedily(nodes, parents, target, num_real, max_depth=tree.max_depth,
                                                          depths=depths, bits=bits)
    else:
        probs = compute_probs(logits, batch)
        probs = (probs if target_row is None else probs[target_row]).view(n, k + 1, -1)
        emitted, num_emitted, path = tree_rejection_sample(
            nodes, parents, probs, [s.request.sampling_params.greedy for s in reqs], [s.request.seed for s in reqs],
            [s.request.num_output_tokens for s in reqs], num_real, max_depth=tree.max_depth, depths=depths, bits=bits)
    return emitted, num_emitted.to(torch.int32), num_real, path


def accept_greedily(
    drafts: torch.Tensor,  # [n, k]
    target: torch.Tensor,  # [n, k + 1] int64: the argmax of each request's k + 1 rows
    num_real: torch.Tensor,  # [n]: real drafts among each request's k slots
) -> tuple[torch.Tensor, torch.Tensor]:  # emitted [n, k + 1] int64 (-1 after the emitted ones), n_acc [n] int64
    """Drafts are kept while they are real and equal the argmax of the row before them; then that argmax is
    emitted."""
    k = drafts.shape[1]
    ok = (torch.arange(k, device=drafts.device) < num_real[:, None]) & (drafts == target[:, :k])
    n_acc = ok.long().cumprod(dim=1).sum(dim=1)
    return torch.where(torch.arange(k + 1, device=drafts.device) <= n_acc[:, None], target, -1), n_acc


def emitted_logprobs(
    logits: torch.Tensor,  # [num_sample_rows, vocab] raw
    sample_rows: list[tuple[int, int]],
    batch: SamplingBatch,
    emitted: list[list[int]],  # per request of the step
) -> list[list[dict[int, Logprob]]]:
    """Row (i, j) emitted token j of request i when the request emitted more than j tokens."""
    keep = [r for r, (i, j) in enumerate(sample_rows) if j < len(emitted[i])]
    ids = torch.tensor([emitted[i][j] for i, j in (sample_rows[r] for r in keep)], device=logits.device)
    rows = torch.tensor(keep, device=logits.device)
    tensors = gather_logprobs(torch.log_softmax(logits[rows].float(), dim=-1), ids, batch.max_num_logprobs)
    out: list[list[dict[int, Logprob]]] = [[] for _ in emitted]
    for r, lp in zip(keep, logprobs_to_dicts(tensors, ids, [batch.num_logprobs[r] for r in keep]), strict=True):
        if lp is not None:
            out[sample_rows[r][0]].append(lp)
    return out
