"""Verify draft tokens against the target: greedy matching or speculative rejection sampling.

Probabilistic rule (Leviathan et al. 2023, Chen et al. 2023). At verified position j of a
request, the drafter proposed x ~ q(.) and the target's processed distribution is p(.):

    accept x                        with probability min(1, p(x) / q(x))
    else emit y ~ norm(max(0, p - q))   and stop

P(emit y) = q(y) min(1, p(y)/q(y)) + (1 - sum_x min(p(x), q(x))) * max(0, p(y) - q(y)) / Z
          = min(p(y), q(y)) + max(0, p(y) - q(y))            (Z = sum_y max(0, p - q) = 1 - sum min)
          = p(y),
so every emitted token is distributed exactly as the target would sample it. When all k drafts are
accepted, one bonus token is sampled from the target at position k. A drafter without
probabilities (ngram, greedy drafts) proposes x deterministically: q is one-hot on x, acceptance
becomes u < p(x) and the residual is p with x removed.

Randomness is counter-based (`research_lm.rng`): the noise of output position `position + j`
depends only on (seed, position + j, stream), so outputs do not depend on batch composition. The
bonus token uses the `SAMPLE` stream, the plain sampler's, so a request with zero drafts samples
exactly the token it would sample without speculation.

Output follows vLLM: `[num_reqs, k_max + 1]` int64, emitted tokens left-aligned, `-1` elsewhere.
"""

from __future__ import annotations

import torch

from research_lm import rng
from research_lm.sampler import random_sample

PLACEHOLDER_TOKEN_ID = -1


def rejection_sample(
    draft_token_ids: list[list[int]],  # per request, k_i drafts (k_i may be 0)
    target_probs: torch.Tensor,  # [sum(k_i + 1), V] float, processed p; request i's rows contiguous
    draft_probs: torch.Tensor | None,  # [sum(k_i), V] float q, or None: one-hot q on each draft
    greedy: torch.Tensor,  # [num_reqs] bool
    seeds: list[int],  # [num_reqs] per-request sampling seed
    positions: list[int],  # [num_reqs] output index of each request's first verified position
) -> torch.Tensor:  # [num_reqs, k_max + 1] int64, -1 in slots not emitted
    """Verify every request's drafts in one batched pass; see the module docstring for the rule.

    Greedy rows only need `target_probs` to be argmax-preserving (one-hot or the processed
    distribution); `draft_probs` rows of greedy requests are ignored.
    """
    device = target_probs.device
    num_reqs = len(draft_token_ids)
    vocab_size = target_probs.shape[-1]
    num_drafts = [len(d) for d in draft_token_ids]
    k_max = max(num_drafts, default=0)
    total_drafts = sum(num_drafts)
    assert len(seeds) == len(positions) == num_reqs and greedy.shape == (num_reqs,)
    assert target_probs.shape[0] == total_drafts + num_reqs, "need k_i + 1 target rows per request"
    assert draft_probs is None or draft_probs.shape == (total_drafts, vocab_size)

    k = torch.tensor(num_drafts, dtype=torch.int64)  # [num_reqs], on CPU for index building
    greedy_cpu = greedy.to("cpu", torch.bool)
    # Row offsets: request i's target rows start at cu_target[i], its draft rows at cu_draft[i].
    cu_draft = torch.cumsum(k, 0) - k  # [num_reqs]
    cu_target = cu_draft + torch.arange(num_reqs)  # [num_reqs]

    # Padded [num_reqs, k_max] views of the drafts; `valid` marks real draft slots.
    slot = torch.arange(k_max)  # [k_max]
    valid = slot[None, :] < k[:, None]  # [num_reqs, k_max]
    drafts = torch.zeros(num_reqs, k_max, dtype=torch.int64)
    drafts[valid] = torch.tensor([t for d in draft_token_ids for t in d], dtype=torch.int64)
    target_rows = cu_target[:, None] + slot[None, :]  # [num_reqs, k_max]

    # --- Acceptance: accepted[i, j] says whether draft j of request i passes its own test. ---
    accepted = torch.zeros(num_reqs, k_max, dtype=torch.bool)
    if total_drafts:
        flat_req, flat_j = torch.nonzero(valid, as_tuple=True)  # [total_drafts] each, row-major
        flat_t, flat_x = target_rows[valid], drafts[valid]  # [total_drafts]
        # The n-th valid slot in row-major order is draft_probs row n (rows are contiguous).
        flat_d = torch.arange(total_drafts)  # [total_drafts]
        ok = target_probs.argmax(-1).cpu()[flat_t] == flat_x  # greedy: draft == target argmax
        rand = ~greedy_cpu[flat_req]  # [total_drafts]
        if rand.any():
            # u < p(x)/q(x) has probability min(1, p(x)/q(x)); written as u * q(x) < p(x) so that
            # q(x) = 0 accepts whenever p(x) > 0 and p(x) = 0 never accepts.
            req, j = flat_req[rand].tolist(), flat_j[rand].tolist()
            u = rng.uniform_rows(
                [seeds[r] for r in req], [positions[r] + jj for r, jj in zip(req, j)], rng.ACCEPT, 1, device
            )[:, 0]  # [n_rand]
            x = flat_x[rand].to(device)
            p_x = target_probs[flat_t[rand].to(device), x].float()  # [n_rand]
            if draft_probs is None:
                q_x = torch.ones_like(p_x)
            else:
                q_x = draft_probs[flat_d[rand].to(device), x].float()
            ok[rand] = (u * q_x < p_x).cpu()
        accepted[valid] = ok
    # Drafts are accepted up to the first failure: n_acc = length of the leading run of True.
    num_accepted = torch.cumprod(accepted.to(torch.int64), dim=1).sum(dim=1)  # [num_reqs]

    # --- The one extra token per request: recovered at the first rejection, else the bonus. ---
    final_rows = cu_target + num_accepted  # [num_reqs] target row of the first unaccepted position
    is_bonus = num_accepted == k  # [num_reqs]
    p_final = target_probs[final_rows.to(device)].float()  # [num_reqs, V]
    final_tokens = p_final.argmax(-1).cpu()  # greedy: target argmax (bonus or correction)

    # Exponential race (`random_sample`): with E_v ~ Exp(1) i.i.d., argmax_v w(v) / E_v ~ w / sum(w)
    # for any w >= 0, so the residual max(0, p - q) needs no normalisation.
    for stream, mask in ((rng.SAMPLE, is_bonus), (rng.RECOVER, ~is_bonus)):
        idx = (~greedy_cpu & mask).nonzero()[:, 0]  # [n] random requests of this kind
        if idx.numel() == 0:
            continue
        idx_dev = idx.to(device)
        weights = p_final[idx_dev]  # [n, V]
        if stream == rng.RECOVER:
            if draft_probs is None:  # one-hot q on the rejected draft: remove it from p
                rejected = drafts[idx, num_accepted[idx]].to(device)  # [n]
                q = torch.zeros_like(weights).scatter_(1, rejected[:, None], 1.0)
            else:
                q = draft_probs[(cu_draft[idx] + num_accepted[idx]).to(device)].float()  # [n, V]
            residual = (weights - q).clamp_min_(0.0)  # max(0, p - q), unnormalised
            # NOTE: a rejection with an all-zero residual means p == q up to rounding, an event of
            # probability 0 in exact arithmetic; fall back to p rather than race on zeros.
            weights = torch.where(residual.sum(-1, keepdim=True) > 0, residual, weights)
        req, n_acc = idx.tolist(), num_accepted[idx].tolist()
        # The plain sampler's own draw: with stream SAMPLE a zero-draft request gets its usual token.
        final_tokens[idx] = random_sample(
            weights, [seeds[i] for i in req], [positions[i] + a for i, a in zip(req, n_acc)], stream
        ).cpu()

    # Emitted: accepted drafts in slots [0, n_acc), the extra token in slot n_acc, -1 after.
    out = torch.full((num_reqs, k_max + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64)
    out[:, :k_max] = torch.where(slot[None, :] < num_accepted[:, None], drafts, PLACEHOLDER_TOKEN_ID)
    out[torch.arange(num_reqs), num_accepted] = final_tokens
    return out.to(device)


def parse_output(
    output_token_ids: torch.Tensor,  # [num_reqs, k_max + 1] int64, the output of rejection_sample
) -> tuple[list[list[int]], list[int]]:
    """Per-request emitted tokens (the -1 slots dropped) and accepted draft counts.

    Every request emits at least one token, so `num_accepted[i] == len(tokens[i]) - 1`.
    """
    tokens = [[t for t in row if t != PLACEHOLDER_TOKEN_ID] for row in output_token_ids.tolist()]
    return tokens, [len(t) - 1 for t in tokens]
