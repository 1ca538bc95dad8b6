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

from itertools import accumulate

import torch

from research_lm import rng
from research_lm.sampler import random_sample

PLACEHOLDER_TOKEN_ID = -1


def rejection_sample(
    draft_token_ids: list[list[int]],  # per request, k_i drafts (k_i may be 0)
    target_probs: torch.Tensor,  # [sum(k_i + 1), V] float, processed p; request i's rows contiguous
    draft_probs: torch.Tensor | None,  # [sum(k_i), V] float q, or None: one-hot q on each draft
    greedy: torch.Tensor | list[bool],  # [num_reqs] bool, on the host (it decides what needs noise)
    seeds: list[int],  # [num_reqs] per-request sampling seed
    positions: list[int],  # [num_reqs] output index of each request's first verified position
) -> torch.Tensor:  # [num_reqs, k_max + 1] int64 on target_probs' device, -1 in slots not emitted
    """Verify every request's drafts in one batched pass; see the module docstring for the rule.

    Greedy rows only need `target_probs` to be argmax-preserving (one-hot or the processed
    distribution); `draft_probs` rows of greedy requests are ignored. Host lists (draft layout,
    seeds, positions) reach the device through pinned non-blocking copies and all the work runs
    there: the caller's `.tolist()` of the result is the only host-device sync.
    """
    device = target_probs.device
    num_reqs = len(draft_token_ids)
    num_drafts = [len(d) for d in draft_token_ids]
    k_max = max(num_drafts, default=0)
    total_drafts = sum(num_drafts)
    greedy_host = greedy.tolist() if isinstance(greedy, torch.Tensor) else list(greedy)
    assert len(seeds) == len(positions) == len(greedy_host) == num_reqs
    assert target_probs.shape[0] == total_drafts + num_reqs, "need k_i + 1 target rows per request"
    assert draft_probs is None or draft_probs.shape == (total_drafts, target_probs.shape[-1])

    # Layout, built on the host and uploaded at once: request i's draft rows start at cu_draft[i],
    # its target rows at cu_target[i] = cu_draft[i] + i; drafts padded to [num_reqs, k_max].
    cu_draft = list(accumulate(num_drafts, initial=0))[:-1]
    cu_target = [c + i for i, c in enumerate(cu_draft)]
    padded = [t for d in draft_token_ids for t in (*d, *[0] * (k_max - len(d)))]
    k, cu_draft_t, cu_target_t, drafts = rng.to_device(
        num_drafts + cu_draft + cu_target + padded, torch.int64, device
    ).split([num_reqs, num_reqs, num_reqs, num_reqs * k_max])
    drafts = drafts.view(num_reqs, k_max)
    slot = torch.arange(k_max, device=device)  # [k_max]
    valid = slot[None, :] < k[:, None]  # [num_reqs, k_max]: real draft slots
    # Target row of each slot (padding slots clamped into range; they are masked by `valid`).
    target_rows = (cu_target_t[:, None] + slot[None, :]).clamp_(max=max(target_probs.shape[0] - 1, 0))

    # --- Acceptance: accepted[i, j] says whether draft j of request i passes its own test. ---
    accepted = target_probs.argmax(-1)[target_rows] == drafts  # greedy: draft == target argmax
    random_reqs = [i for i, g in enumerate(greedy_host) if not g]
    r = rng.to_device(random_reqs, torch.int64, device) if random_reqs else None  # [n] random requests
    if r is not None and k_max:
        # u < p(x)/q(x) has probability min(1, p(x)/q(x)); written as u * q(x) < p(x) so that
        # q(x) = 0 accepts whenever p(x) > 0 and p(x) = 0 never accepts.
        u = rng.uniform_rows(
            [seeds[i] for i in random_reqs for _ in range(k_max)],
            [positions[i] + j for i in random_reqs for j in range(k_max)], rng.ACCEPT, 1, device,
        ).view(len(random_reqs), k_max)
        x = drafts[r]  # [n, k_max]
        p_x = target_probs[target_rows[r], x].float()
        if draft_probs is None:
            q_x = torch.ones_like(p_x)
        else:
            draft_rows = (cu_draft_t[r, None] + slot[None, :]).clamp_(max=max(total_drafts - 1, 0))
            q_x = draft_probs[draft_rows, x].float()
        accepted = accepted.index_copy(0, r, u * q_x < p_x)
    # Drafts are accepted up to the first failure: n_acc = length of the leading run of True.
    num_accepted = torch.cumprod((accepted & valid).to(torch.int64), dim=1).sum(dim=1)  # [num_reqs]

    # --- The one extra token per request: recovered at the first rejection, else the bonus. ---
    p_final = target_probs[cu_target_t + num_accepted].float()  # [num_reqs, V]
    final_tokens = p_final.argmax(-1)  # greedy: target argmax (bonus or correction)
    if r is not None:
        # Exponential race (`random_sample`): with E_v ~ Exp(1) i.i.d., argmax_v w(v) / E_v ~ w / sum(w)
        # for any w >= 0, so the residual max(0, p - q) needs no normalisation.
        n_acc = num_accepted[r]  # [n]
        is_bonus = n_acc == k[r]  # [n]
        weights = p_final[r]  # [n, V]
        if total_drafts:
            if draft_probs is None:  # one-hot q on the rejected draft: remove it from p
                rejected = drafts[r].gather(1, n_acc.clamp(max=k_max - 1)[:, None])  # [n, 1]
                residual = weights.scatter(1, rejected, 0.0)
            else:
                q = draft_probs[(cu_draft_t[r] + n_acc).clamp_(max=total_drafts - 1)].float()  # [n, V]
                residual = (weights - q).clamp_min_(0.0)  # max(0, p - q), unnormalised
            # NOTE: a rejection with an all-zero residual means p == q up to rounding, an event of
            # probability 0 in exact arithmetic; fall back to p rather than race on zeros.
            residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, weights)
            weights = torch.where(is_bonus[:, None], weights, residual)
        # The bonus uses the plain sampler's own draw (stream SAMPLE): a zero-draft request gets its
        # usual token; a recovery draws from the RECOVER stream, both at position + n_acc.
        stream = torch.where(is_bonus, rng.SAMPLE, rng.RECOVER)
        pos = rng.to_device([positions[i] for i in random_reqs], torch.int64, device) + n_acc
        drawn = random_sample(weights, [seeds[i] for i in random_reqs], pos, stream)
        final_tokens = final_tokens.index_copy(0, r, drawn)

    # Emitted: accepted drafts in slots [0, n_acc), the extra token in slot n_acc, -1 after.
    out = torch.full((num_reqs, k_max + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
    out[:, :k_max] = torch.where(slot[None, :] < num_accepted[:, None], drafts, PLACEHOLDER_TOKEN_ID)
    return out.scatter_(1, num_accepted[:, None], final_tokens[:, None])


def parse_output(
    output_token_ids: torch.Tensor,  # [num_reqs, k_max + 1] int64, the output of rejection_sample
) -> tuple[list[list[int]], list[int]]:
    """Per-request emitted tokens (the -1 slots dropped) and accepted draft counts.

    Every request emits at least one token, so `num_accepted[i] == len(tokens[i]) - 1`.
    """
    tokens = [[t for t in row if t != PLACEHOLDER_TOKEN_ID] for row in output_token_ids.tolist()]
    return tokens, [len(t) - 1 for t in tokens]
