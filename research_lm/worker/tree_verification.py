"""Verify a token tree of drafts against the target in one step: greedy matching or multi-draft rejection sampling.

Layout. Nodes 0..N of a request's tree; node 0 is the root (its newest token, already emitted), nodes 1..N are
drafts, `parents[j] < j` (-1 for the root), siblings ordered by rank (lower index = higher-ranked child). The
target's row j (its logits at node j's query position) is p(. | prefix, path to j): the law of node j's children
and of the token after node j. Tree drafts are deterministic (top-k children, Medusa's top-r tokens): each child is
a fixed token x, so there is no draft q.

Greedy rule. A node is accepted iff its parent is and its token is the argmax of its parent's row. The request
emits the drafts on the path to the deepest accepted node, then that node's argmax.

Probabilistic rule (SpecInfer, Miao et al. 2024; EAGLE-2, Li et al. 2024). At the current node (first the root),
with p_cur its row, try its children x_1, x_2, ... in rank order: x_i is accepted with probability p_cur(x_i);
if rejected, set p_cur(x_i) = 0, renormalise, and try the next child. An accepted child becomes the current node
(with its own fresh row); when no child is accepted (or the node is a leaf), emit y ~ p_cur and stop.

Proof that every emitted token follows the target. Fix a node with row p and children x_1..x_m, and let
R_i = {x_1, ..., x_i} (R_0 empty). After i rejections p_cur is p_i(y) = p(y) [y not in R_i] / (1 - p(R_i)).
Couple the rule to one draw Y ~ p: trying x_{i+1} asks "is Y = x_{i+1}?" given the answers so far ("Y is not in
R_i"). Given Y not in R_i, Y is distributed as p restricted to the complement of R_i, renormalised: that is p_i,
so the answer is yes with probability p_i(x_{i+1}), exactly the acceptance probability. This is why the later
sibling's renormalised p_cur is the right conditional: it is the target's law given everything the earlier
rejections revealed. In numbers: the chance of reaching child i + 1 is r_{i+1} = 1 - p(R_i), by induction
(r_1 = 1; r_{i+1} = r_i (1 - p_{i-1}(x_i)) = 1 - p(R_{i-1}) - p(x_i) [x_i not in R_{i-1}] = 1 - p(R_i)), so

    P(emit x_i by accepting child i) = r_i p_{i-1}(x_i) = p(x_i)      (0 for a repeat of an earlier sibling)
    P(emit y after m rejections)      = (1 - p(R_m)) p_m(y) = p(y)     for y not in R_m,

and each token y is emitted with probability p(y) (the two lines cover disjoint y). Moreover a child's token is
emitted only by accepting that child, and then the walk goes on from the child's row, which is the target's law
of the next token given the prefix with y appended; any other token ends the step, and the next step samples what
follows from the target anew. By induction over depth, the emitted sequence (continued by later steps) has the
target's joint law. Deterministic drafts are a function of the context, never of this step's noise, so
conditioning on the tree changes nothing. A chain (one child per node) is the one-hot-q case of
`research_lm.worker.rejection_sampler`, and gives its tokens exactly (the same uniforms, keys and residual).

Randomness is counter-based (`research_lm.worker.rng`), so a request's outputs never depend on the batch. The
token emitted at output index position + d (d = depth of the current node) uses keys at position + d: the test of
a child of rank r uses column r of the ACCEPT stream's row; the final token is an exponential race (`race`) with
the SAMPLE stream when p_cur is the untouched row (a leaf, or no child tried), so a tree without real drafts draws
the token plain sampling draws, and with the RECOVER stream after a rejection. Along one path every (depth, rank)
is tried at most once, so all the draws are independent.

Everything runs on the device without a host sync (capturable in a CUDA graph) once `max_depth` is given: the
Python loops run over node indices, never over data (the greedy rule and the path: a fixed handful of ops). One
pass over the nodes in index order applies the probabilistic rule: node j is tried iff it is real and its parent is
the current node, since an accepted node's children come after it and its later siblings then no longer hang off
the current node.

Outputs follow `research_lm.worker.rejection_sampler`: emitted [n, D + 1] int64 (the path's drafts, then the final
token, -1 after), num_emitted [n] int32, path [n, D + 1] int64 (root, then each accepted node, -1 after).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from research_lm.worker import rng
from research_lm.worker.rejection_sampler import PLACEHOLDER_TOKEN_ID
from research_lm.worker.sampler import race
from research_lm.worker.token_tree import tree_tables

TreeOutputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # emitted, num_emitted, path


def chain_parents(k: int) -> torch.Tensor:  # [k + 1] int64: -1, 0, 1, ..., k - 1
    """A chain of k drafts as a tree: node j's parent is node j - 1."""
    return torch.arange(-1, k, dtype=torch.int64)


def _tables(parents: torch.Tensor, depths: torch.Tensor | None,
            bits: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:  # [n, N + 1] each
    """The trees' depths and ancestor masks: as given (a static tree's [N + 1] expand), else from parents."""
    if depths is None or bits is None:
        return tree_tables(parents)
    n, width = parents.shape
    return depths.expand(n, width), bits.expand(n, width)


def accept_tree_greedily(
    node_tokens: torch.Tensor,  # [n, N + 1] int64, column 0 (the root's token) unused
    parents: torch.Tensor,  # [n, N + 1] or [N + 1] (a static tree) int64
    target: torch.Tensor,  # [n, N + 1] int64: the argmax of each node's row
    num_real: torch.Tensor | Sequence[int] | None = None,  # [n]: nodes past num_real[i] are never accepted
    *,
    max_depth: int | None = None,  # >= the tree's depth, the outputs' D; None: read from parents (a host sync)
    depths: torch.Tensor | None = None,  # [N + 1] or [n, N + 1]: each node's depth, where known (a static tree)
    bits: torch.Tensor | None = None,  # [N + 1] or [n, N + 1] int64: each node's ancestors and itself, bit j node j
) -> TreeOutputs:  # emitted [n, D + 1] int64, num_emitted [n] int32, path [n, D + 1] int64
    """Accept the nodes whose token is their parent's argmax (and whose parent is accepted); emit the path to the
    deepest accepted node (ties: the lowest index), then that node's argmax. Without both depths and the ancestor
    masks `bits` (the runner's `DeviceTree` keeps them) they are computed from parents."""
    n, width = node_tokens.shape
    parents = parents.expand(n, width)
    depths, bits = _tables(parents, depths, bits)
    real = _real_nodes(num_real, n, width, node_tokens.device)
    return _greedy(node_tokens, parents, depths, bits, target, real, _max_depth(depths, max_depth))


def tree_rejection_sample(
    node_tokens: torch.Tensor,  # [n, N + 1] int64, column 0 unused
    parents: torch.Tensor,  # [n, N + 1] or [N + 1] (a static tree) int64
    target_probs: torch.Tensor,  # [n, N + 1, V] float: the processed p of each node's row (rows sum to 1)
    greedy: torch.Tensor | Sequence[bool],  # [n] bool: argmax rows (accept_tree_greedily's result)
    seeds: torch.Tensor | Sequence[int],  # [n] per-request sampling seed
    positions: torch.Tensor | Sequence[int],  # [n] output index of the first token this step may emit
    num_real: torch.Tensor | Sequence[int] | None = None,  # [n]: nodes past num_real[i] are never accepted
    *,
    max_depth: int | None = None,  # >= the tree's depth, the outputs' D; None: read from parents (a host sync)
    depths: torch.Tensor | None = None,  # [N + 1] or [n, N + 1]: each node's depth, where known (a static tree)
    bits: torch.Tensor | None = None,  # [N + 1] or [n, N + 1] int64: each node's ancestors and itself, bit j node j
) -> TreeOutputs:  # emitted [n, D + 1] int64, num_emitted [n] int32, path [n, D + 1] int64
    """Walk each request's tree by the multi-draft rule of the module docstring; greedy rows take the argmax rule.

    A host `greedy` (a sequence, not a tensor) lets an all-greedy or all-random batch skip the other rule's work."""
    n, width, _ = target_probs.shape
    device = target_probs.device
    parents = parents.expand(n, width)
    depths, bits = _tables(parents, depths, bits)
    depth = _max_depth(depths, max_depth)
    real = _real_nodes(num_real, n, width, device)
    host_known = not isinstance(greedy, torch.Tensor)
    if host_known and all(greedy):
        return _greedy(node_tokens, parents, depths, bits, target_probs.argmax(-1), real, depth)
    sampled = _sample(node_tokens, parents, depths, bits, target_probs, real, _int64_on(seeds, device),
                      _int64_on(positions, device), depth)
    if host_known and not any(greedy):
        return sampled
    by_argmax = _greedy(node_tokens, parents, depths, bits, target_probs.argmax(-1), real, depth)
    greedy_t = rng.to_device(greedy, torch.bool, device)
    return tuple(torch.where(greedy_t.view(-1, *[1] * (a.dim() - 1)), a, b) for a, b in zip(by_argmax, sampled))


def _max_depth(depths: torch.Tensor, max_depth: int | None) -> int:
    if max_depth is not None:
        return max_depth
    return int(depths.max()) if depths.numel() else 0  # a host sync on an accelerator: pass max_depth there


def _real_nodes(
    num_real: torch.Tensor | Sequence[int] | None, n: int, width: int, device: torch.device
) -> torch.Tensor:  # [n, N + 1] bool: node j <= num_real[i] (the root's entry: unused)
    if num_real is None:
        return torch.ones(n, width, dtype=torch.bool, device=device)
    return torch.arange(width, device=device) <= rng.to_device(num_real, torch.int64, device)[:, None]


def _int64_on(values: torch.Tensor | Sequence[int], device: torch.device) -> torch.Tensor:  # [n] int64
    if not isinstance(values, torch.Tensor):
        values = [rng.int64_bits(int(v)) for v in values]  # seeds past int64: the same bits mod 2^64
    return rng.to_device(values, torch.int64, device)


def _greedy(
    node_tokens: torch.Tensor,  # [n, N + 1] int64
    parents: torch.Tensor,  # [n, N + 1] int64
    depths: torch.Tensor,  # [n, N + 1] int64
    bits: torch.Tensor,  # [n, N + 1] int64 ancestor masks
    target: torch.Tensor,  # [n, N + 1] int64 argmax of each row
    real: torch.Tensor,  # [n, N + 1] bool
    max_depth: int,
) -> TreeOutputs:
    # A node is accepted iff it and every ancestor pass (the root: always; a draft: real and its parent's argmax),
    # i.e. iff its mask lies within the passing nodes' mask. A fixed handful of ops, each a launch on the GPU (a tree
    # step's ops run eagerly), whatever the tree's depth.
    passes = real & (node_tokens == target.gather(1, parents.clamp(min=0)))
    powers = 1 << torch.arange(passes.shape[1], device=passes.device)
    passing = torch.where(passes, powers, 0).sum(1, keepdim=True) | 1  # (distinct powers of 2: their sum is their OR)
    accepted = (bits & passing) == bits
    last = torch.where(accepted, depths, -1).argmax(1, keepdim=True)  # the deepest; argmax: the first (lowest) index
    return _path_outputs(node_tokens, depths, bits, last, target.gather(1, last), max_depth)


def _sample(
    node_tokens: torch.Tensor,  # [n, N + 1] int64
    parents: torch.Tensor,  # [n, N + 1] int64
    depths: torch.Tensor,  # [n, N + 1] int64
    bits: torch.Tensor,  # [n, N + 1] int64 ancestor masks
    target_probs: torch.Tensor,  # [n, N + 1, V] float
    real: torch.Tensor,  # [n, N + 1] bool
    seeds: torch.Tensor,  # [n] int64
    positions: torch.Tensor,  # [n] int64
    max_depth: int,
) -> TreeOutputs:
    n, width, vocab = target_probs.shape
    tokens = torch.where(real, node_tokens, 0)  # nodes past num_real may hold anything, even out-of-vocab ids
    earlier_siblings = _earlier_siblings(parents)  # [n, N + 1, N + 1]
    rows = torch.arange(n, device=tokens.device)[:, None]
    # p(x_j) in the parent's row; 0 for a repeat of an earlier sibling, whose rejection already zeroed it.
    p_node = target_probs[rows, parents.clamp(min=0), tokens].float()
    repeats = (earlier_siblings & (tokens[:, :, None] == tokens[:, None, :])).any(-1)
    p_node = torch.where(repeats, 0.0, p_node)
    u = _acceptance_uniforms(seeds, positions, depths, earlier_siblings.sum(-1), max_depth)

    current = torch.zeros(n, dtype=torch.int64, device=tokens.device)
    mass = torch.ones(n, device=tokens.device)  # sum of p_cur: 1 at a fresh row, less what was rejected
    rejected = [torch.zeros(n, dtype=torch.bool, device=tokens.device)]
    for j in range(1, width):
        tried = real[:, j] & (parents[:, j] == current)
        p_x = p_node[:, j]
        # u < p_cur(x) / mass, written so that p(x) = 0 never accepts even if rounding left mass <= 0.
        accept = tried & (p_x > 0) & (u[:, j] * mass < p_x)
        reject = tried & ~accept
        mass = torch.where(accept, 1.0, torch.where(reject, mass - p_x, mass))
        current = torch.where(accept, j, current)
        rejected.append(reject)
    # The residual: the current row without its rejected children's tokens (the race needs no normalising).
    cut = torch.stack(rejected, 1) & (parents == current[:, None])  # [n, N + 1]
    row = target_probs[rows[:, 0], current].float()  # [n, V]
    residual = torch.nn.functional.pad(row, (0, 1)).scatter_(1, torch.where(cut, tokens, vocab), 0.0)[:, :vocab]
    # NOTE: an all-zero residual means the rejected children held all of p, which happens only by rounding (the
    # last of them is accepted with probability 1 in exact arithmetic): fall back to the row.
    weights = torch.where(residual.sum(-1, keepdim=True) > 0, residual, row)
    touched = cut.any(1)
    stream = torch.where(touched, rng.RECOVER, rng.SAMPLE)
    keys = rng.row_keys(seeds, positions + depths.gather(1, current[:, None]).squeeze(1), stream)
    return _path_outputs(node_tokens, depths, bits, current[:, None], race(weights, keys)[:, None], max_depth)


def _earlier_siblings(parents: torch.Tensor) -> torch.Tensor:  # [n, N + 1] -> [n, N + 1, N + 1] bool
    """[i, j, k]: node k is a sibling of node j with a lower index (a higher rank)."""
    width = parents.shape[1]
    lower = torch.ones(width, width, dtype=torch.bool, device=parents.device).tril_(-1)
    return (parents[:, :, None] == parents[:, None, :]) & lower


def _acceptance_uniforms(
    seeds: torch.Tensor,  # [n] int64
    positions: torch.Tensor,  # [n] int64
    depths: torch.Tensor,  # [n, N + 1] int64
    ranks: torch.Tensor,  # [n, N + 1] int64: each node's rank among its siblings
    max_depth: int,
) -> torch.Tensor:  # [n, N + 1] float32: node j's uniform (column 0 unused)
    """Node j's test uses column rank(j) of the ACCEPT row at position + depth(parent(j)): the output index its
    token would take. A chain's node j reads column 0 at position + j - 1, as rejection_sample's slot j - 1."""
    n, width = depths.shape
    if width == 1 or max_depth == 0:
        return torch.ones(n, width, device=depths.device)
    levels = torch.arange(max_depth, device=depths.device)
    u = rng.uniform_rows(seeds.repeat_interleave(max_depth), (positions[:, None] + levels).view(-1), rng.ACCEPT,
                         width - 1, depths.device).view(n, max_depth, width - 1)
    rows = torch.arange(n, device=depths.device)[:, None]
    return u[rows, (depths - 1).clamp(0, max_depth - 1), ranks.clamp(max=width - 2)]


def _path_outputs(
    node_tokens: torch.Tensor,  # [n, N + 1] int64
    depths: torch.Tensor,  # [n, N + 1] int64
    bits: torch.Tensor,  # [n, N + 1] int64 ancestor masks
    last: torch.Tensor,  # [n, 1] int64: the path's last node
    final_token: torch.Tensor,  # [n, 1] int64: the token emitted after it
    max_depth: int,
) -> TreeOutputs:
    """The root-to-`last` path (the nodes whose mask lies within `last`'s, each at its depth's column), its drafts,
    then `final_token`: a scatter each, the nodes off the path into a spare last column, dropped."""
    n, width = node_tokens.shape
    column = torch.where((bits & bits.gather(1, last)) == bits, depths, max_depth + 2)  # [n, N + 1]
    nodes = torch.arange(width, device=last.device).expand(n, width)
    path = torch.full((n, max_depth + 3), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=last.device)
    path = path.scatter_(1, column, nodes)[:, : max_depth + 1]
    # the buffer's column d + 1 holds emitted token d: the drafts at their depths (the root's in column 0), then
    # the final token after the last one
    after = depths.gather(1, last) + 1  # [n, 1]
    emitted = torch.full((n, max_depth + 3), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=last.device)
    emitted = emitted.scatter_(1, column, node_tokens).scatter_(1, after, final_token)[:, 1 : max_depth + 2]
    return emitted.contiguous(), after.squeeze(1).to(torch.int32), path  # (callers view emitted flat)
