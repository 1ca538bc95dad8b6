"""Token-tree verification: the greedy rule against a naive walk, and exactness of the multi-draft sampling rule.

Invariant: whatever the tree, each emitted token follows the target's distribution given the tokens before it
(chi-square at 10^5 draws), greedy rows give the argmax rule, and a request's outputs depend only on its own inputs.
"""

from __future__ import annotations

import math

import pytest
import torch

from research_lm.api.sampling_params import SamplingParams
from research_lm.engine.request import Request
from research_lm.worker.rejection_sampler import PLACEHOLDER_TOKEN_ID, rejection_sample
from research_lm.worker.sampler import Sampler, SamplingBatch, compute_probs, random_sample
from research_lm.worker.token_tree import tree_tables
from research_lm.worker.tree_verification import (
    accept_tree_greedily,
    chain_parents,
    tree_rejection_sample,
)
from research_lm.worker.verification import accept_greedily
from tests.test_rejection_sampler import _SYNC_OPS, chi2_pvalue, random_probs
from tests.test_sampler import CountOps

NUM_DRAWS = 100_000


def random_bfs_tree(gen: torch.Generator, num_drafts: int) -> list[int]:
    """Parents of a random tree in BFS order: random level sizes, each level's parents non-decreasing."""
    cuts = sorted(torch.randperm(num_drafts - 1, generator=gen)[: int(torch.randint(0, num_drafts, (1,),
                                                                                       generator=gen))].tolist())
    sizes = [b - a for a, b in zip([0, *[c + 1 for c in cuts]], [*[c + 1 for c in cuts], num_drafts])]
    parents, level = [-1], [0]
    for size in sizes:
        picks = sorted(level[i] for i in torch.randint(0, len(level), (size,), generator=gen).tolist())
        level = list(range(len(parents), len(parents) + size))
        parents += picks
    return parents


def star_parents(k: int) -> list[int]:  # the root with k children
    return [-1] + [0] * k


def naive_greedy(tokens: list[int], parents: list[int], target: list[int], num_real: int, max_depth: int):
    """One request, node by node in Python: (emitted, num_emitted, path), padded to max_depth + 1."""
    depth, accepted = [0], [True]
    for j in range(1, len(parents)):
        depth.append(depth[parents[j]] + 1)
        accepted.append(j <= num_real and accepted[parents[j]] and tokens[j] == target[parents[j]])
    last = min((j for j in range(len(parents)) if accepted[j]), key=lambda j: (-depth[j], j))
    path = [last]
    while path[-1] != 0:
        path.append(parents[path[-1]])
    path.reverse()
    emitted = [tokens[j] for j in path[1:]] + [target[last]]
    pad = [PLACEHOLDER_TOKEN_ID] * (max_depth + 1)
    return (emitted + pad)[: max_depth + 1], len(emitted), (path + pad)[: max_depth + 1]


TREE_SHAPES = {
    "chain": lambda gen: chain_parents(5).tolist(),
    "star": lambda gen: star_parents(6),
    "medusa": lambda gen: [-1, 0, 0, 0, 1, 1, 2, 4],
    "random": lambda gen: random_bfs_tree(gen, 9),
}


# --- Greedy -------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", TREE_SHAPES)
@pytest.mark.parametrize("per_request", [False, True])
@pytest.mark.parametrize("masks", [False, True], ids=["walk", "ancestor_masks"])
def test_greedy_equals_naive_walk(shape, per_request, masks):
    """Random trees (one static tree, or one per request), a 3-token vocabulary so that siblings repeat tokens
    and several subtrees match (ties), and random num_real; by walking up the tree, or from the ancestor masks (what
    the runner passes)."""
    gen = torch.Generator().manual_seed(len(shape) * 2 + per_request)
    n = 200
    parents = torch.tensor([TREE_SHAPES[shape](gen) for _ in range(n)] if per_request
                           else [TREE_SHAPES[shape](gen)] * n)
    width = parents.shape[1]
    tokens = torch.randint(0, 3, (n, width), generator=gen)
    target = torch.randint(0, 3, (n, width), generator=gen)
    num_real = torch.randint(0, width + 2, (n,), generator=gen)
    max_depth = int(tree_tables(parents)[0].max())
    bits = tree_tables(parents)[1] if masks else None
    emitted, num_emitted, path = accept_tree_greedily(tokens, parents if per_request else parents[0], target,
                                                      num_real, bits=bits)
    want = [naive_greedy(tokens[i].tolist(), parents[i].tolist(), target[i].tolist(), int(num_real[i]), max_depth)
            for i in range(n)]
    assert emitted.dtype == path.dtype == torch.int64 and num_emitted.dtype == torch.int32
    assert emitted.tolist() == [w[0] for w in want]
    assert num_emitted.tolist() == [w[1] for w in want]
    assert path.tolist() == [w[2] for w in want]
    assert len(set(num_emitted.tolist())) > 1


def test_greedy_ties_take_the_deepest_then_the_lowest_index():
    """Both root children match; the deeper subtree wins, else the lower index."""
    parents = torch.tensor([-1, 0, 0, 1, 2, 4])
    tokens = torch.tensor([[9, 5, 5, 7, 7, 3], [9, 5, 5, 7, 7, 0]])
    target = torch.tensor([[5, 7, 7, 8, 3, 4], [5, 7, 7, 8, 3, 4]])
    emitted, num_emitted, path = accept_tree_greedily(tokens, parents, target)
    assert path.tolist() == [[0, 2, 4, 5], [0, 1, 3, -1]]
    assert emitted.tolist() == [[5, 7, 3, 4], [5, 7, 8, -1]]
    assert num_emitted.tolist() == [4, 3]


@pytest.mark.parametrize("seed", range(3))
def test_greedy_chain_equals_accept_greedily(seed):
    gen = torch.Generator().manual_seed(seed)
    n, k = 300, 4
    target = torch.randint(0, 4, (n, k + 1), generator=gen)
    drafts = torch.where(torch.rand(n, k, generator=gen) < 0.7, target[:, :k], torch.randint(0, 4, (n, k),
                                                                                          generator=gen))
    num_real = torch.randint(0, k + 1, (n,), generator=gen)
    emitted, num_emitted, path = accept_tree_greedily(torch.cat([target[:, :1], drafts], 1), chain_parents(k),
                                                      target, num_real)
    want, n_acc = accept_greedily(drafts, target, num_real)
    assert torch.equal(emitted, want) and torch.equal(num_emitted, (n_acc + 1).int())
    assert torch.equal(path, torch.where(torch.arange(k + 1) <= n_acc[:, None], torch.arange(k + 1), -1))


# --- Sampling: a chain --------------------------------------------------------------------------

CHAIN_VOCAB, CHAIN_K = 12, 2


@pytest.fixture(scope="module")
def chain_draws():
    """A chain of CHAIN_K deterministic drafts per request, num_real in 0..K, every request seeing row p_j at
    depth j: slot j's emitted token must follow p_j (tests/test_rejection_sampler.py's spec_draws, one-hot)."""
    gen = torch.Generator().manual_seed(6)
    p = random_probs(CHAIN_K + 1, CHAIN_VOCAB, gen)  # [K + 1, V]
    num_real = torch.randint(0, CHAIN_K + 1, (NUM_DRAWS,), generator=gen)
    cycle = (torch.arange(NUM_DRAWS)[:, None] * 5 + torch.arange(CHAIN_K)[None, :]) % CHAIN_VOCAB
    drafts = torch.where(torch.arange(NUM_DRAWS)[:, None] % 2 == 0, p[:CHAIN_K].argmax(-1)[None, :], cycle)
    seeds, positions = list(range(NUM_DRAWS)), torch.randint(0, 1000, (NUM_DRAWS,), generator=gen).tolist()
    tokens = torch.cat([torch.zeros(NUM_DRAWS, 1, dtype=torch.int64), drafts], 1)
    out = tree_rejection_sample(tokens, chain_parents(CHAIN_K), p.expand(NUM_DRAWS, -1, -1),
                                [False] * NUM_DRAWS, seeds, positions, num_real)
    return p, drafts, num_real, seeds, positions, out


def test_chain_slots_follow_the_target(chain_draws):
    p, _, _, _, _, (emitted, num_emitted, _) = chain_draws
    for j in range(CHAIN_K + 1):
        col = emitted[:, j]
        tokens = col[col != PLACEHOLDER_TOKEN_ID]
        assert len(tokens) >= (NUM_DRAWS if j == 0 else 5_000)
        counts = torch.bincount(tokens, minlength=CHAIN_VOCAB)
        assert chi2_pvalue(counts, p[j]) > 0.01, f"slot {j}: {counts.tolist()} vs {p[j].tolist()}"
    assert set(num_emitted.tolist()) == {1, 2, 3}


def test_chain_l2_distance_shrinks(chain_draws):
    p, _, _, _, _, (emitted, _, _) = chain_draws
    assert_l2_shrinks(emitted[:, 0], p[0])


def test_chain_equals_the_chain_rejection_sampler(chain_draws):
    """Same uniforms, keys and residual: exactly rejection_sample's tokens with one-hot q."""
    p, drafts, num_real, seeds, positions, (emitted, _, _) = chain_draws
    n = 20_000
    lists = [d[:k] for d, k in zip(drafts[:n].tolist(), num_real[:n].tolist())]
    rows = torch.cat([torch.arange(k + 1) for k in num_real[:n].tolist()])
    want = rejection_sample(lists, p[rows], None, [False] * n, seeds[:n], positions[:n])
    assert torch.equal(emitted[:n], torch.nn.functional.pad(want, (0, CHAIN_K + 1 - want.shape[1]), value=-1))


def assert_l2_shrinks(samples: torch.Tensor, probs: torch.Tensor) -> None:
    """vLLM's check: |empirical - p| falls with the draws, to within 3x its expectation sqrt(sum p(1-p) / n)."""
    distances = []
    for n in (1_000, 10_000, NUM_DRAWS):
        empirical = torch.bincount(samples[:n], minlength=len(probs)).double() / n
        distances.append(float((empirical - probs.double()).norm()))
    assert distances[0] > distances[1] > distances[2]
    assert distances[2] < 3 * math.sqrt(float((probs * (1 - probs)).sum()) / NUM_DRAWS)


# --- Sampling: a branching tree ------------------------------------------------------------------

VOCAB = 6
BRANCHING = torch.tensor([-1, 0, 0, 0, 1, 1])  # root: nodes 1, 2, 3; node 1: nodes 4, 5


def branching_drafts(p0: torch.Tensor, p1: torch.Tensor) -> torch.Tensor:  # [NUM_DRAWS, 6] int64
    """Deterministic drafts, a function of the request: top-k children (a), cycling tokens with p = 0 ones among
    them (b), a repeated sibling (c)."""
    i = torch.arange(NUM_DRAWS)
    top = torch.zeros(NUM_DRAWS, 6, dtype=torch.int64)
    top[:, 1:4] = p0.topk(3).indices
    top[:, 4:6] = p1[top[:, 1]].topk(2).indices
    cycle = (i[:, None] * torch.tensor([0, 1, 2, 3, 5, 4]) + torch.arange(6)) % VOCAB
    repeat = cycle.clone()
    repeat[:, 2] = repeat[:, 1]
    return torch.stack([top, cycle, repeat])[i % 3, i]


@pytest.fixture(scope="module")
def branching_draws():
    """A target model over VOCAB tokens (p0 at the root, p1[a] after a, p2[a, b] after a b) and per request a
    BRANCHING tree of deterministic drafts whose node rows are the model's rows along each node's path.

    Returns the model, the outputs, and each draw's second token: the emitted one, or where the step emitted one
    token, the next step's plain sample (SAMPLE stream at position + 1), so (first, second) must be p0(a) p1[a](b)."""
    gen = torch.Generator().manual_seed(9)
    p0 = random_probs(1, VOCAB, gen, zero_frac=0.2)[0]
    p1 = random_probs(VOCAB, VOCAB, gen, zero_frac=0.1)
    p2 = random_probs(VOCAB * VOCAB, VOCAB, gen).view(VOCAB, VOCAB, VOCAB)
    tokens = branching_drafts(p0, p1)
    rows = torch.stack([p0.expand(NUM_DRAWS, -1), *(p1[tokens[:, j]] for j in (1, 2, 3)),
                        *(p2[tokens[:, 1], tokens[:, j]] for j in (4, 5))], 1)  # [N, 6, V]
    num_real = torch.randint(0, 6, (NUM_DRAWS,), generator=gen).clamp(min=2)
    seeds, positions = torch.arange(NUM_DRAWS) + 7, torch.randint(0, 1000, (NUM_DRAWS,), generator=gen)
    out = tree_rejection_sample(tokens, BRANCHING, rows, torch.zeros(NUM_DRAWS, dtype=torch.bool), seeds,
                                positions, num_real, max_depth=2)
    emitted, num_emitted, _ = out
    next_step = random_sample(p1[emitted[:, 0]], seeds, positions + 1)
    second = torch.where(num_emitted >= 2, emitted[:, 1], next_step)
    return (p0, p1), out, second


def test_branching_first_token_follows_the_target(branching_draws):
    (p0, _), (emitted, _, _), _ = branching_draws
    counts = torch.bincount(emitted[:, 0], minlength=VOCAB)
    assert chi2_pvalue(counts, p0) > 0.01, f"{counts.tolist()} vs {p0.tolist()}"
    assert_l2_shrinks(emitted[:, 0], p0)


def test_branching_pairs_follow_the_target(branching_draws):
    (p0, p1), (emitted, _, _), second = branching_draws
    joint = (p0[:, None] * p1).flatten()  # [V * V]: P(first = a, second = b)
    assert (joint[joint > 0] * NUM_DRAWS).min() > 5  # the chi-square approximation holds
    pairs = emitted[:, 0] * VOCAB + second
    counts = torch.bincount(pairs, minlength=VOCAB * VOCAB)
    assert chi2_pvalue(counts, joint) > 0.01
    assert_l2_shrinks(pairs, joint)


def test_branching_walk_takes_every_route(branching_draws):
    """Later siblings are accepted after rejections, both depths are reached, and rejections recover."""
    _, (emitted, num_emitted, path), _ = branching_draws
    assert set(path[:, 1].tolist()) == {-1, 1, 2, 3}
    assert set(path[:, 2].tolist()) == {-1, 4, 5}
    assert set(num_emitted.tolist()) == {1, 2, 3}
    assert ((path >= 0).sum(1) == num_emitted).all()


# --- Greedy rows, zero drafts, batch independence, no sync ------------------------------------------


def random_tree_batch(gen: torch.Generator, n: int, vocab: int, width: int = 8):
    """Per-request random trees, drafts half right (the parent's argmax), random rows, num_real and greedy."""
    parents = torch.tensor([random_bfs_tree(gen, width - 1) for _ in range(n)])
    probs = random_probs(n * width, vocab, gen).view(n, width, vocab)
    right = probs.argmax(-1).gather(1, parents.clamp(min=0))
    tokens = torch.where(torch.rand(n, width, generator=gen) < 0.5, right,
                         torch.randint(0, vocab, (n, width), generator=gen))
    num_real = torch.randint(0, width + 1, (n,), generator=gen)
    greedy = torch.rand(n, generator=gen) < 0.4
    seeds, positions = torch.randint(0, 2**62, (n,), generator=gen), torch.randint(0, 500, (n,), generator=gen)
    return tokens, parents, probs, greedy, seeds, positions, num_real


def test_greedy_rows_equal_accept_tree_greedily():
    gen = torch.Generator().manual_seed(21)
    tokens, parents, probs, greedy, seeds, positions, num_real = random_tree_batch(gen, 300, 9)
    got = tree_rejection_sample(tokens, parents, probs, greedy, seeds, positions, num_real, max_depth=7)
    want = accept_tree_greedily(tokens, parents, probs.argmax(-1), num_real, max_depth=7)
    for a, b in zip(got, want):
        assert torch.equal(a[greedy], b[greedy])
    assert not torch.equal(got[0][~greedy], want[0][~greedy])
    all_greedy = tree_rejection_sample(tokens, parents, probs, [True] * 300, seeds, positions, num_real, max_depth=7)
    assert all(torch.equal(a, b) for a, b in zip(all_greedy, want))


def test_zero_real_drafts_sample_like_the_plain_sampler():
    """num_real = 0, and a tree without drafts: the SAMPLE stream at the position, as plain sampling draws."""
    gen = torch.Generator().manual_seed(22)
    tokens, parents, probs, _, seeds, positions, _ = random_tree_batch(gen, 400, 11)
    plain = random_sample(probs[:, 0], seeds, positions)
    random_rows = torch.zeros(400, dtype=torch.bool)
    emitted, num_emitted, path = tree_rejection_sample(tokens, parents, probs, random_rows, seeds, positions,
                                                       torch.zeros(400, dtype=torch.int64))
    assert torch.equal(emitted[:, 0], plain) and (num_emitted == 1).all() and (path[:, 0] == 0).all()
    emitted, _, _ = tree_rejection_sample(tokens[:, :1], parents[:, :1], probs[:, :1], random_rows, seeds, positions)
    assert emitted.shape == (400, 1) and torch.equal(emitted[:, 0], plain)


def test_zero_real_drafts_reproduce_the_sampler_end_to_end():
    """compute_probs(logits) at the root of a tree without real drafts == the plain Sampler's tokens."""
    gen = torch.Generator().manual_seed(23)
    vocab = 40
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=5),
              SamplingParams(temperature=1.3, top_p=0.9), SamplingParams(min_p=0.05)]
    reqs = [Request(f"r{i}", [1, 2, 3], params[i % 4], seed=17 + i,
                    output_token_ids=torch.randint(0, vocab, (i % 5,), generator=gen).tolist()) for i in range(24)]
    logits = torch.randn(24, vocab, generator=gen) * 3
    batch = SamplingBatch.build(reqs, vocab)
    root = compute_probs(logits, batch)[:, None, :]  # [24, 1, V]
    emitted, _, _ = tree_rejection_sample(torch.zeros(24, 1, dtype=torch.int64), chain_parents(0), root,
                                          batch.greedy_mask, batch.seeds, batch.positions)
    assert torch.equal(emitted[:, 0], Sampler()(logits, batch).token_ids)


def test_outputs_do_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(24)
    n = 60
    batch = random_tree_batch(gen, n, 10)

    def run(order: torch.Tensor) -> list[tuple]:
        outs = tree_rejection_sample(*(x[order] for x in batch), max_depth=7)
        return list(zip(*(x.tolist() for x in outs)))

    full = run(torch.arange(n))
    shuffled = torch.randperm(n, generator=gen)
    assert run(shuffled) == [full[i] for i in shuffled.tolist()]
    subset = shuffled[:9]
    assert run(subset) == [full[i] for i in subset.tolist()]
    assert all(run(torch.tensor([i])) == [full[i]] for i in range(0, n, 13))
    tokens, parents, probs, greedy, seeds, positions, num_real = batch
    other = tree_rejection_sample(tokens, parents, probs, greedy, seeds + 1, positions, num_real, max_depth=7)
    assert list(zip(*(x.tolist() for x in other))) != full


@pytest.mark.parametrize("rule", ["greedy", "sample"])
def test_ops_do_not_grow_with_batch_size_and_read_no_device_value(rule):
    """With max_depth given and device inputs: the same torch ops for 4 requests as for 64, and none that brings a
    device value to the host (on CPU the stand-in for "no host sync", i.e. capturable)."""

    def count(n: int) -> list[str]:
        gen = torch.Generator().manual_seed(n)
        tokens, parents, probs, greedy, seeds, positions, num_real = random_tree_batch(gen, n, 10)
        with CountOps() as ops:
            if rule == "greedy":
                accept_tree_greedily(tokens, parents, probs.argmax(-1), num_real, max_depth=7)
            else:
                tree_rejection_sample(tokens, parents, probs, greedy, seeds, positions, num_real, max_depth=7)
        return ops.names

    names = count(4)
    assert names == count(64) and not _SYNC_OPS & set(names)

