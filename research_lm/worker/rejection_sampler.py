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

Randomness is counter-based (`research_lm.worker.rng`): the noise of output position `position + j`
depends only on (seed, position + j, stream), so outputs do not depend on batch composition. The
bonus token uses the `SAMPLE` stream, the plain sampler's, so a request with zero drafts samples
exactly the token it would sample without speculation.

Output follows vLLM: `[num_reqs, k_max + 1]` int64, emitted tokens left-aligned, `-1` elsewhere.

On CUDA (`research_lm.ops.FUSED_DEVICE_TYPES`, outside torch.compile) one Triton kernel does all the device
work (research_lm/ops/rejection_kernel.py), with this module's torch code as its reference: the same tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

import research_lm.ops
from research_lm.worker import rng
from research_lm.worker.sampler import race

PLACEHOLDER_TOKEN_ID = -1


class _HostPlan(NamedTuple):
    """What depends only on host values (the layout, the uniforms, the noise keys), for both device paths."""

    num_drafts: np.ndarray  # [num_reqs] int64 k_i, request i's draft slots
    cu_draft: np.ndarray  # [num_reqs] int64, request i's first draft (and draft_probs) row
    cu_target: np.ndarray  # [num_reqs] int64, its first target row: cu_draft[i] + i
    greedy: np.ndarray  # [num_reqs] bool
    u: np.ndarray  # [num_reqs, K] float32, the acceptance uniform of slot j (ACCEPT stream at position + j)
    recover_keys: np.ndarray  # [num_reqs, K + 1] uint64, the noise key of a recovery after n_acc accepted drafts
    sample_keys: np.ndarray  # [num_reqs, K + 1] uint64, the noise key of the bonus after n_acc accepted drafts


def rejection_sample(
    draft_token_ids: list[list[int]] | torch.Tensor,  # per request k_i drafts, or [num_reqs, K] int on the device
    target_probs: torch.Tensor,  # [sum(k_i + 1), V] float, processed p; request i's rows contiguous
    draft_probs: torch.Tensor | None,  # [sum(k_i), V] float q, or None: one-hot q on each draft
    greedy: torch.Tensor | list[bool],  # [num_reqs] bool, on the host (it decides what needs noise)
    seeds: list[int],  # [num_reqs] per-request sampling seed
    positions: list[int],  # [num_reqs] output index of each request's first verified position
    *,
    num_drafts: list[int] | None = None,  # [num_reqs] k_i on the host: the tensor form's layout (required there)
    num_valid: torch.Tensor | None = None,  # [num_reqs] int on the device: real drafts per request; None: k_i
) -> torch.Tensor:  # [num_reqs, K + 1] int64 on target_probs' device, -1 in slots not emitted
    """Verify every request's drafts in one batched pass; see the module docstring for the rule.

    Drafts come as host lists (K = the longest), or as a device tensor whose row i holds request i's k_i =
    `num_drafts[i]` scheduled slots first (K = its width). The prob rows follow the k_i layout either way. Only
    the first `num_valid[i]` slots hold real drafts (a device drafter may find fewer than it was scheduled);
    later slots are never accepted, so the result is the list form's for the drafts cut to num_valid[i]: the
    bonus (SAMPLE stream) when all those are accepted, else the recovery, at the same positions.

    Greedy rows only need `target_probs` to be argmax-preserving (one-hot or the processed
    distribution); `draft_probs` rows of greedy requests are ignored. Everything that depends only on
    host values (the row layout, the acceptance uniforms, the noise keys of both streams for every n_acc)
    is computed with numpy and reaches the device in pinned non-blocking copies; which key the final token
    uses is chosen on the device. The device work is one kernel on CUDA (~30 batched torch kernels
    elsewhere) whatever the batch, and the caller's `.tolist()` of the result is the only host-device sync.
    """
    device = target_probs.device
    k = _num_drafts(draft_token_ids, num_drafts, num_valid, device)
    num_reqs = len(k)
    greedy_host = np.asarray(greedy.tolist() if isinstance(greedy, torch.Tensor) else greedy, dtype=bool)
    k_max = draft_token_ids.shape[1] if isinstance(draft_token_ids, torch.Tensor) else int(k.max(initial=0))
    total_drafts = int(k.sum())
    assert len(seeds) == len(positions) == len(greedy_host) == num_reqs
    assert target_probs.shape[0] == total_drafts + num_reqs, "need k_i + 1 target rows per request"
    assert draft_probs is None or draft_probs.shape == (total_drafts, target_probs.shape[-1])

    cu_draft = np.cumsum(k) - k
    drafts = draft_token_ids
    if not isinstance(drafts, torch.Tensor):  # [num_reqs, K], zeros past k_i
        drafts = np.zeros((num_reqs, k_max), dtype=np.int64)
        drafts[np.arange(k_max)[None, :] < k[:, None]] = [t for d in draft_token_ids for t in d]
    # Noise keys of every final token request i might emit, one per n_acc in 0 .. K: a recovery draws from the
    # RECOVER stream at position + n_acc, the bonus from the plain sampler's SAMPLE stream, so a zero-draft
    # request gets exactly the token it would sample without speculation. Where the bonus falls (n_acc =
    # num_valid[i]) may be known only on the device, so both keys go there.
    seeds_col, pos = np.asarray(seeds, dtype=object)[:, None], np.asarray(positions, dtype=np.int64)[:, None]
    final_pos = pos + np.arange(k_max + 1)[None, :]
    # u < p(x)/q(x) has probability min(1, p(x)/q(x)): one uniform per slot, ACCEPT stream at position + j.
    plan = _HostPlan(k, cu_draft, cu_draft + np.arange(num_reqs), greedy_host,
                     rng.host_uniform(rng.host_keys(seeds_col, pos + np.arange(k_max)[None, :], rng.ACCEPT)),
                     rng.host_keys(seeds_col, final_pos, rng.RECOVER), rng.host_keys(seeds_col, final_pos, rng.SAMPLE))
    if device.type in research_lm.ops.FUSED_DEVICE_TYPES and not torch.compiler.is_compiling():
        from research_lm.ops.rejection_kernel import fused_rejection_sample, pack_host

        host = pack_host(plan.u, plan.recover_keys, plan.sample_keys, plan.num_drafts, plan.cu_draft, plan.cu_target,
                         plan.greedy)
        if isinstance(drafts, np.ndarray):  # one pinned copy carries the drafts and the rest
            up = rng.to_device(torch.from_numpy(np.concatenate([drafts, host], axis=1)), torch.int64, device)
            drafts, host_t = up[:, :k_max], up[:, k_max:]
        else:
            drafts = drafts if drafts.stride(-1) == 1 else drafts.contiguous()
            host_t = rng.to_device(torch.from_numpy(host), torch.int64, device)
        return fused_rejection_sample(target_probs.float().contiguous(),
                                      None if draft_probs is None else draft_probs.float().contiguous(),
                                      drafts, host_t, None if num_valid is None else num_valid.contiguous(), k_max)
    return _verify(drafts, num_valid, target_probs, draft_probs, plan)


def _num_drafts(
    draft_token_ids: list[list[int]] | torch.Tensor, num_drafts: list[int] | None, num_valid: torch.Tensor | None,
    device: torch.device,
) -> np.ndarray:  # [num_reqs] int64 k_i
    """Each request's draft slots, after checking the drafts' form, `num_drafts` and `num_valid` (host metadata
    only: nothing here reads a device value)."""
    if isinstance(draft_token_ids, torch.Tensor):
        d = draft_token_ids
        if d.dim() != 2 or d.dtype not in (torch.int32, torch.int64) or d.device != device:
            raise ValueError(f"draft_token_ids as a tensor must be [num_reqs, k_max] int32 or int64 on {device} "
                             f"(target_probs' device); got {d.dtype} {tuple(d.shape)} on {d.device}")
        if num_drafts is None:
            raise ValueError("num_drafts (each request's scheduled draft slots, on the host) is required when "
                             "draft_token_ids is a tensor")
        k = np.asarray(num_drafts, dtype=np.int64)
        if k.shape != (d.shape[0],) or (k < 0).any() or (k > d.shape[1]).any():
            raise ValueError(f"num_drafts must give one count in 0..{d.shape[1]} (draft_token_ids' width) for "
                             f"each of its {d.shape[0]} rows; got {list(num_drafts)}")
    else:
        k = np.asarray([len(x) for x in draft_token_ids], dtype=np.int64)
        if num_drafts is not None and list(num_drafts) != k.tolist():
            raise ValueError(f"num_drafts {list(num_drafts)} differs from the draft lists' lengths {k.tolist()}; "
                             "leave it out with lists")
    if num_valid is not None and (num_valid.shape != (len(k),) or num_valid.device != device
                                  or num_valid.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"num_valid must be [num_reqs] = [{len(k)}] int32 or int64 on {device}; got "
                         f"{num_valid.dtype} {tuple(num_valid.shape)} on {num_valid.device}")
    return k


def _verify(
    drafts: np.ndarray | torch.Tensor,  # [num_reqs, K] int, host (zeros past k_i) or device (anything past n_real)
    num_valid: torch.Tensor | None,  # [num_reqs] int on the device, or None: k_i
    target_probs: torch.Tensor,  # [sum(k_i + 1), V] float
    draft_probs: torch.Tensor | None,  # [sum(k_i), V] float, or None
    plan: _HostPlan,
) -> torch.Tensor:  # [num_reqs, K + 1] int64
    """The device work in batched torch ops: the kernel's reference."""
    device = target_probs.device
    num_reqs, k_max = plan.u.shape
    total_drafts = int(plan.num_drafts.sum())
    any_random, any_greedy = not plan.greedy.all(), bool(plan.greedy.any())

    # --- Host: slot j < k_i of request i reads draft row cu_draft[i] + j and target row cu_target[i] + j;
    # padding slots point at row 0 and are never accepted. ---
    slot = np.arange(k_max)
    layout = slot[None, :] < plan.num_drafts[:, None]  # [num_reqs, K]
    target_rows = np.where(layout, plan.cu_target[:, None] + slot, 0)
    draft_rows = np.where(layout, plan.cu_draft[:, None] + slot, 0)
    host_drafts = isinstance(drafts, np.ndarray)
    parts = ([drafts] if host_drafts else []) + [
        target_rows, draft_rows, plan.num_drafts, plan.cu_draft, plan.cu_target, plan.greedy,
        plan.recover_keys.view(np.int64), plan.sample_keys.view(np.int64)]
    up = rng.to_device(torch.from_numpy(np.concatenate([a.reshape(-1).astype(np.int64) for a in parts])),
                       torch.int64, device)
    sizes = [num_reqs * k_max] * (2 + host_drafts) + [num_reqs] * 4 + [num_reqs * (k_max + 1)] * 2
    *host_drafts_t, target_rows_t, draft_rows_t, k, cu_draft_t, cu_target_t, greedy_t, recover_t, sample_t = (
        up.split(sizes))
    drafts_t = (host_drafts_t[0] if host_drafts else drafts).view(num_reqs, k_max).long()
    target_rows_t, draft_rows_t = (x.view(num_reqs, k_max) for x in (target_rows_t, draft_rows_t))
    greedy_t = greedy_t.bool()
    # Real drafts per request; clamped to the layout, since a larger count would read the next request's rows.
    n_real = k if num_valid is None else torch.minimum(num_valid.long().clamp(min=0), k)  # [num_reqs]
    valid_t = torch.arange(k_max, device=device) < n_real[:, None]  # [num_reqs, K]
    drafts_t = torch.where(valid_t, drafts_t, 0)  # slots past n_real may hold anything, even out-of-vocab ids

    # --- Acceptance: accepted[i, j] says whether draft j of request i passes its own test. ---
    accepted = valid_t
    if k_max and any_random:
        # Written as u * q(x) < p(x) so that q(x) = 0 accepts whenever p(x) > 0 and p(x) = 0 never accepts.
        p_x = target_probs[target_rows_t, drafts_t].float()
        q_x = 1.0 if draft_probs is None else draft_probs[draft_rows_t, drafts_t].float()
        u_t = rng.to_device(torch.from_numpy(plan.u), torch.float32, device)
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
            use = (num_accepted < n_real)[:, None] & (residual.sum(-1, keepdim=True) > 0)
            weights = torch.where(use, residual, p_final)
        n_acc = num_accepted[:, None]
        keys = torch.where(n_acc == n_real[:, None], sample_t.view(num_reqs, k_max + 1).gather(1, n_acc),
                           recover_t.view(num_reqs, k_max + 1).gather(1, n_acc))[:, 0]  # [num_reqs]
        final_tokens = race(weights, keys)
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
