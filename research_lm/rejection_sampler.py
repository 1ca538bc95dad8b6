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

On CUDA (`research_lm.ops.FUSED_DEVICE_TYPES`, outside torch.compile) one Triton kernel does all the device
work (research_lm/ops/rejection_kernel.py), with this module's torch code as its reference: the same tokens.
"""

from __future__ import annotations

import numpy as np
import torch

import research_lm.ops
from research_lm import rng
from research_lm.sampler import race

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
    distribution); `draft_probs` rows of greedy requests are ignored. Everything that depends only on
    the host lists (the row layout, the acceptance uniforms, the noise keys of every possible final
    token) is computed with numpy and reaches the device in pinned non-blocking copies; the device work
    is one kernel on CUDA (~30 batched torch kernels elsewhere) whatever the batch, and the caller's
    `.tolist()` of the result is the only host-device sync.
    """
    device = target_probs.device
    num_reqs = len(draft_token_ids)
    greedy_host = np.asarray(greedy.tolist() if isinstance(greedy, torch.Tensor) else greedy, dtype=bool)
    num_drafts = np.asarray([len(d) for d in draft_token_ids], dtype=np.int64)
    k_max, total_drafts = int(num_drafts.max(initial=0)), int(num_drafts.sum())
    assert len(seeds) == len(positions) == len(greedy_host) == num_reqs
    assert target_probs.shape[0] == total_drafts + num_reqs, "need k_i + 1 target rows per request"
    assert draft_probs is None or draft_probs.shape == (total_drafts, target_probs.shape[-1])
    any_random, any_greedy = not greedy_host.all(), bool(greedy_host.any())

    # --- Host: request i's draft rows start at cu_draft[i], its target rows at cu_target[i] = cu_draft[i] + i;
    # slot j < k_i of request i is draft j (padding slots point at row 0 and are masked by `valid`). ---
    cu_draft = np.cumsum(num_drafts) - num_drafts
    cu_target = cu_draft + np.arange(num_reqs)
    slot = np.arange(k_max)
    valid = slot[None, :] < num_drafts[:, None]  # [num_reqs, k_max]
    drafts = np.zeros((num_reqs, k_max), dtype=np.int64)
    drafts[valid] = [t for d in draft_token_ids for t in d]
    # Noise keys of every final token request i might emit, one per n_acc in 0 .. k_max: a recovery draws from
    # the RECOVER stream at position + n_acc, the bonus (n_acc = k_i) from the plain sampler's SAMPLE stream,
    # so a zero-draft request gets exactly the token it would sample without speculation.
    seeds_col, pos = np.asarray(seeds, dtype=object)[:, None], np.asarray(positions, dtype=np.int64)[:, None]
    n_acc_all = np.arange(k_max + 1)[None, :]
    final_keys = rng.host_keys(seeds_col, pos + n_acc_all, np.where(n_acc_all == num_drafts[:, None], rng.SAMPLE,
                                                                     rng.RECOVER))  # [num_reqs, k_max + 1]
    # u < p(x)/q(x) has probability min(1, p(x)/q(x)): one uniform per slot, ACCEPT stream at position + j.
    u = rng.host_uniform(rng.host_keys(seeds_col, pos + slot, rng.ACCEPT))  # [num_reqs, k_max]
    if device.type in research_lm.ops.FUSED_DEVICE_TYPES and not torch.compiler.is_compiling():
        from research_lm.ops.rejection_kernel import fused_rejection_sample, pack_host

        packed = pack_host(drafts, u, final_keys, num_drafts, cu_draft, cu_target, greedy_host)
        return fused_rejection_sample(target_probs.float().contiguous(),
                                      None if draft_probs is None else draft_probs.float().contiguous(),
                                      rng.to_device(torch.from_numpy(packed), torch.int64, device), k_max)
    target_rows = np.where(valid, cu_target[:, None] + slot, 0)
    draft_rows = np.where(valid, cu_draft[:, None] + slot, 0)
    host = np.concatenate([a.reshape(-1).astype(np.int64) for a in (
        drafts, target_rows, draft_rows, valid, num_drafts, cu_draft, cu_target, greedy_host,
        final_keys.view(np.int64))])
    up = rng.to_device(torch.from_numpy(host), torch.int64, device)
    sizes = [num_reqs * k_max] * 4 + [num_reqs] * 4 + [num_reqs * (k_max + 1)]
    drafts_t, target_rows_t, draft_rows_t, valid_t, k, cu_draft_t, cu_target_t, greedy_t, keys_t = up.split(sizes)
    drafts_t, target_rows_t, draft_rows_t = (x.view(num_reqs, k_max) for x in (drafts_t, target_rows_t, draft_rows_t))
    valid_t, greedy_t = valid_t.view(num_reqs, k_max).bool(), greedy_t.bool()

    # --- Acceptance: accepted[i, j] says whether draft j of request i passes its own test. ---
    accepted = valid_t
    if k_max and any_random:
        # Written as u * q(x) < p(x) so that q(x) = 0 accepts whenever p(x) > 0 and p(x) = 0 never accepts.
        p_x = target_probs[target_rows_t, drafts_t].float()
        q_x = 1.0 if draft_probs is None else draft_probs[draft_rows_t, drafts_t].float()
        u_t = rng.to_device(torch.from_numpy(u), torch.float32, device)
        accepted = accepted & (u_t * q_x < p_x)
    if k_max and any_greedy:  # greedy: draft == target argmax
        matches = target_probs.argmax(-1)[target_rows_t] == drafts_t
        accepted = torch.where(greedy_t[:, None], valid_t & matches, accepted)
    # Drafts are accepted up to the first failure: n_acc = length of the leading run of True.
    num_accepted = torch.cumprod(accepted.long(), dim=1).sum(dim=1)  # [num_reqs]

    # --- The one extra token per request: recovered at the first rejection, else the bonus. ---
    p_final = target_probs[cu_target_t + num_accepted].float()  # [num_reqs, V]
    if any_random:
        # Exponential race (`race`): with E_v ~ Exp(1) i.i.d., argmax_v w(v) / E_v ~ w / sum(w) for any
        # w >= 0, so the residual max(0, p - q) needs no normalisation.
        weights = p_final
        if total_drafts:
            if draft_probs is None:  # one-hot q on the rejected draft: remove it from p
                rejected = drafts_t.gather(1, num_accepted.clamp(max=k_max - 1)[:, None])  # [num_reqs, 1]
                residual = p_final.scatter(1, rejected, 0.0)
            else:
                q = draft_probs[(cu_draft_t + num_accepted).clamp_(max=total_drafts - 1)].float()  # [num_reqs, V]
                residual = (p_final - q).clamp_min_(0.0)  # max(0, p - q), unnormalised
            # NOTE: a rejection with an all-zero residual means p == q up to rounding, an event of
            # probability 0 in exact arithmetic; fall back to p rather than race on zeros.
            use = (num_accepted < k)[:, None] & (residual.sum(-1, keepdim=True) > 0)
            weights = torch.where(use, residual, p_final)
        final_tokens = race(weights, keys_t.view(num_reqs, k_max + 1).gather(1, num_accepted[:, None])[:, 0])
        if any_greedy:  # target argmax (bonus or correction)
            final_tokens = torch.where(greedy_t, p_final.argmax(-1), final_tokens)
    else:
        final_tokens = p_final.argmax(-1)

    # Emitted: accepted drafts in slots [0, n_acc), the extra token in slot n_acc, -1 after.
    out = torch.full((num_reqs, k_max + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
    out[:, :k_max] = torch.where(torch.arange(k_max, device=device) < num_accepted[:, None], drafts_t,
                                 PLACEHOLDER_TOKEN_ID)
    return out.scatter_(1, num_accepted[:, None], final_tokens[:, None])


def parse_output(
    output_token_ids: torch.Tensor,  # [num_reqs, k_max + 1] int64, the output of rejection_sample
) -> tuple[list[list[int]], list[int]]:
    """Per-request emitted tokens (the -1 slots dropped) and accepted draft counts.

    Every request emits at least one token, so `num_accepted[i] == len(tokens[i]) - 1`.
    """
    tokens = [[t for t in row if t != PLACEHOLDER_TOKEN_ID] for row in output_token_ids.tolist()]
    return tokens, [len(t) - 1 for t in tokens]
