"""Rejection sampler: vLLM output conventions, the greedy rule, and exactness of the probabilistic rule.

Invariant: whatever the drafts, every emitted token is distributed as the target's processed
distribution at its position (checked with a chi-square test over >= 10^5 draws), and a request's
output depends only on its own (seed, position, inputs), never on the rest of the batch.
"""

from __future__ import annotations

import math

import pytest
import torch

from research_lm import rng
from research_lm.rejection_sampler import PLACEHOLDER_TOKEN_ID, parse_output, rejection_sample
from research_lm.request import Request
from research_lm.sampler import Sampler, SamplingBatch, compute_probs, random_sample
from research_lm.sampling_params import SamplingParams
from tests.test_sampler import CountOps

CPU = torch.device("cpu")


def random_probs(n: int, vocab: int, gen: torch.Generator, zero_frac: float = 0.25) -> torch.Tensor:
    """[n, vocab] rows with random shapes and some exact zeros (as top-k / top-p leave them)."""
    logits = torch.randn(n, vocab, generator=gen) * 1.5
    drop = torch.rand(n, vocab, generator=gen) < zero_frac
    drop[torch.arange(n), logits.argmax(-1)] = False  # keep at least one token per row
    return torch.softmax(logits.masked_fill(drop, float("-inf")), dim=-1)


def pad(rows: list[list[int]], width: int) -> torch.Tensor:
    return torch.tensor([r + [PLACEHOLDER_TOKEN_ID] * (width - len(r)) for r in rows], dtype=torch.int64)


def naive_greedy(drafts: list[list[int]], target_probs: torch.Tensor) -> list[list[int]]:
    out, row = [], 0
    for d in drafts:
        argmax = target_probs[row : row + len(d) + 1].argmax(-1).tolist()
        emitted = []
        for j, x in enumerate(d):
            emitted.append(argmax[j])
            if x != argmax[j]:
                break
        else:
            emitted.append(argmax[len(d)])  # bonus
        out.append(emitted)
        row += len(d) + 1
    return out


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; survival function via the regularised upper gamma."""
    n = counts.sum()
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a token of probability 0"
    expected = n * probs[support].double()
    stat = ((counts[support].double() - expected) ** 2 / expected).sum()
    df = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def test_chi2_pvalue_helper_matches_known_values():
    # chi2 survival function with 2 dof is exp(-x/2); with 1 dof at 3.841 it is 0.05.
    p = torch.tensor([0.5, 0.5])
    assert chi2_pvalue(torch.tensor([60, 40]), p) == pytest.approx(0.0455, abs=1e-4)  # x=4, df=1
    p3 = torch.full((3,), 1 / 3)
    counts = torch.tensor([40, 30, 30])  # x = 2
    assert chi2_pvalue(counts, p3) == pytest.approx(math.exp(-1), rel=1e-6)


# --- Conventions and the greedy rule -----------------------------------------------------------


def make_greedy_batch(gen: torch.Generator, num_reqs: int, vocab: int, k_max: int):
    num_drafts = torch.randint(0, k_max + 1, (num_reqs,), generator=gen).tolist()
    target_probs = random_probs(sum(num_drafts) + num_reqs, vocab, gen)
    argmax = target_probs.argmax(-1).tolist()
    drafts, row = [], 0
    for k in num_drafts:
        # Mostly-right drafters, so acceptance runs of every length occur.
        right = torch.rand(k, generator=gen) < 0.7
        wrong = torch.randint(0, vocab, (k,), generator=gen).tolist()
        drafts.append([argmax[row + j] if right[j] else wrong[j] for j in range(k)])
        row += k + 1
    return drafts, target_probs


@pytest.mark.parametrize("seed", range(5))
def test_greedy_equals_naive_rule(seed):
    gen = torch.Generator().manual_seed(seed)
    drafts, target_probs = make_greedy_batch(gen, num_reqs=40, vocab=10, k_max=4)
    k_max = max(len(d) for d in drafts)
    out = rejection_sample(
        drafts, target_probs, None, torch.ones(40, dtype=torch.bool), list(range(40)), [0] * 40
    )
    assert torch.equal(out, pad(naive_greedy(drafts, target_probs), k_max + 1))
    # Greedy ignores draft probabilities.
    draft_probs = random_probs(sum(len(d) for d in drafts), 10, gen)
    out_q = rejection_sample(
        drafts, target_probs, draft_probs, torch.ones(40, dtype=torch.bool), list(range(40)), [0] * 40
    )
    assert torch.equal(out, out_q)


def test_output_shape_and_placeholders():
    gen = torch.Generator().manual_seed(1)
    vocab, num_reqs = 9, 64
    num_drafts = [i % 5 for i in range(num_reqs)]
    drafts = [torch.randint(0, vocab, (k,), generator=gen).tolist() for k in num_drafts]
    target_probs = random_probs(sum(num_drafts) + num_reqs, vocab, gen)
    draft_probs = random_probs(sum(num_drafts), vocab, gen)
    greedy = torch.arange(num_reqs) % 3 == 0
    out = rejection_sample(drafts, target_probs, draft_probs, greedy, list(range(num_reqs)), [5] * num_reqs)
    assert out.shape == (num_reqs, 5) and out.dtype == torch.int64
    tokens, num_accepted = parse_output(out)
    for i, (row, toks, n_acc) in enumerate(zip(out.tolist(), tokens, num_accepted)):
        n = len(toks)
        assert 1 <= n <= num_drafts[i] + 1 and n_acc == n - 1
        assert row[:n] == toks and all(t == PLACEHOLDER_TOKEN_ID for t in row[n:])
        assert toks[: n - 1] == drafts[i][: n - 1]  # accepted slots carry the drafts themselves
        assert all(0 <= t < vocab for t in toks)


def test_zero_drafts_everywhere_gives_one_column():
    gen = torch.Generator().manual_seed(2)
    target_probs = random_probs(6, 7, gen)
    out = rejection_sample([[]] * 6, target_probs, None, torch.zeros(6, dtype=torch.bool), [1] * 6, [3] * 6)
    assert out.shape == (6, 1) and (out >= 0).all()
    empty = rejection_sample([], target_probs[:0], None, torch.zeros(0, dtype=torch.bool), [], [])
    assert empty.shape == (0, 1)


def test_zero_drafts_samples_like_the_plain_sampler():
    """A request without drafts draws its token with the SAMPLE stream at its position."""
    gen = torch.Generator().manual_seed(3)
    probs = random_probs(200, 11, gen)
    seeds, positions = list(range(100, 300)), list(range(200))
    out = rejection_sample([[]] * 200, probs, None, torch.zeros(200, dtype=torch.bool), seeds, positions)
    noise = rng.exponential_rows(seeds, positions, rng.SAMPLE, 11, CPU)
    assert torch.equal(out[:, 0], (probs / noise).argmax(-1))
    assert torch.equal(out[:, 0], random_sample(probs, seeds, positions))


def test_zero_drafts_reproduce_the_sampler_end_to_end():
    """Runner path: compute_probs(logits) into the rejection sampler == the plain Sampler's tokens."""
    gen = torch.Generator().manual_seed(8)
    vocab = 50
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=5),
              SamplingParams(temperature=1.3, top_p=0.9, presence_penalty=0.5), SamplingParams(min_p=0.05)]
    reqs = []
    for i in range(24):
        r = Request(f"r{i}", [1, 2, 3], params[i % 4], seed=17 + i)
        r.output_token_ids = torch.randint(0, vocab, (i % 6,), generator=gen).tolist()
        reqs.append(r)
    logits = torch.randn(24, vocab, generator=gen) * 3
    batch = SamplingBatch.build(reqs, vocab)
    out = rejection_sample(
        [[]] * 24, compute_probs(logits, batch), None, batch.greedy_mask, batch.seeds, batch.positions
    )
    assert torch.equal(out[:, 0], Sampler()(logits, batch).token_ids)


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_always_right_and_always_wrong_drafters(greedy, with_draft_probs):
    """One-hot targets: a right drafter gets k + 1 tokens, a wrong one exactly the target's token."""
    gen = torch.Generator().manual_seed(4)
    vocab, k, num_reqs = 8, 4, 32
    target_tokens = torch.randint(0, vocab, (num_reqs, k + 1), generator=gen)
    target_probs = torch.nn.functional.one_hot(target_tokens.flatten(), vocab).float()
    right = target_tokens[:, :k].tolist()
    wrong = ((target_tokens[:, :k] + torch.randint(1, vocab, (num_reqs, k), generator=gen)) % vocab).tolist()
    draft_probs = random_probs(num_reqs * k, vocab, gen, zero_frac=0.0) if with_draft_probs else None
    args = (torch.full((num_reqs,), greedy), list(range(num_reqs)), [7] * num_reqs)

    out = rejection_sample(right, target_probs, draft_probs, *args)
    assert torch.equal(out, target_tokens)  # tau = k + 1, bonus included
    out = rejection_sample(wrong, target_probs, draft_probs, *args)
    assert torch.equal(out[:, 0], target_tokens[:, 0])  # tau = 1, the target's own token
    assert (out[:, 1:] == PLACEHOLDER_TOKEN_ID).all()


def test_draft_equal_to_target_is_always_accepted():
    """q == p: the acceptance ratio is 1, so every draft sampled from q is accepted (tau = k + 1)."""
    gen = torch.Generator().manual_seed(5)
    vocab, k, num_reqs = 10, 3, 500
    p = random_probs(num_reqs * (k + 1), vocab, gen).view(num_reqs, k + 1, vocab)
    drafts = torch.multinomial(p[:, :k].reshape(-1, vocab), 1, generator=gen).view(num_reqs, k)
    out = rejection_sample(
        drafts.tolist(),
        p.reshape(-1, vocab),
        p[:, :k].reshape(-1, vocab),
        torch.zeros(num_reqs, dtype=torch.bool),
        list(range(num_reqs)),
        [0] * num_reqs,
    )
    assert torch.equal(out[:, :k], drafts) and (out[:, k] >= 0).all()


# --- Exactness of the probabilistic rule -------------------------------------------------------

VOCAB = 12
NUM_DRAWS = 100_000
K = 2


@pytest.fixture(scope="module", params=["draft_probs", "one_hot"])
def spec_draws(request):
    """Emitted tokens of NUM_DRAWS requests with mixed draft counts in 0..K, in one call.

    Every request sees the same target distribution p_j at verified position j (and p_K at the
    bonus), so slot j's emitted token must follow p_j, whatever was drafted.
    """
    gen = torch.Generator().manual_seed(6)
    p = random_probs(K + 1, VOCAB, gen)  # [K + 1, V]
    num_drafts = torch.randint(0, K + 1, (NUM_DRAWS,), generator=gen)  # [N]
    if request.param == "draft_probs":
        # A drafter close to the target, with mass where p = 0 and none on a token where p > 0.
        q = 0.6 * p[:K] + 0.4 * random_probs(K, VOCAB, gen)  # [K, V]
        smallest = p[:K].masked_fill(p[:K] == 0, 2.0).argmin(-1)  # [K]
        q[torch.arange(K), smallest] = 0.0
        q /= q.sum(-1, keepdim=True)
        assert ((q > 0) & (p[:K] == 0)).any() and ((q == 0) & (p[:K] > 0)).any()
        samples = torch.stack([torch.multinomial(q[j], NUM_DRAWS, replacement=True, generator=gen)
                               for j in range(K)], dim=1)  # [N, K]
    else:
        # Deterministic drafts (a function of the request, i.e. of its context): the target's
        # argmax for half the requests, every other token (p = 0 ones included) for the rest.
        q = None
        cycle = (torch.arange(NUM_DRAWS)[:, None] * 5 + torch.arange(K)[None, :]) % VOCAB  # [N, K]
        samples = torch.where(torch.arange(NUM_DRAWS)[:, None] % 2 == 0, p[:K].argmax(-1)[None, :], cycle)
    drafts = [s[:k] for s, k in zip(samples.tolist(), num_drafts.tolist())]
    target_rows = _rows_within_request(num_drafts + 1)  # [sum(k_i + 1)]: 0..k_i per request
    draft_rows = _rows_within_request(num_drafts)  # [sum(k_i)]: 0..k_i - 1 per request
    out = rejection_sample(
        drafts,
        p[target_rows],
        None if q is None else q[draft_rows],
        torch.zeros(NUM_DRAWS, dtype=torch.bool),
        seeds=list(range(NUM_DRAWS)),
        positions=torch.randint(0, 1000, (NUM_DRAWS,), generator=gen).tolist(),
    )
    return p, out


def _rows_within_request(counts: torch.Tensor) -> torch.Tensor:  # [R] -> [sum(counts)]
    starts = torch.cumsum(counts, 0) - counts
    return torch.arange(int(counts.sum())) - torch.repeat_interleave(starts, counts)


def test_emitted_tokens_follow_target_distribution(spec_draws):
    p, out = spec_draws
    for j in range(K + 1):
        col = out[:, j]
        emitted = col[col != PLACEHOLDER_TOKEN_ID]
        assert len(emitted) >= (NUM_DRAWS if j == 0 else 5_000)
        counts = torch.bincount(emitted, minlength=VOCAB)
        assert chi2_pvalue(counts, p[j]) > 0.01, f"slot {j}: {counts.tolist()} vs {p[j].tolist()}"


def test_l2_distance_shrinks_with_sample_size(spec_draws):
    """vLLM's check: the empirical distribution converges to p as draws grow (~1/sqrt(n))."""
    p, out = spec_draws
    distances = []
    for n in (1_000, 10_000, 100_000):
        empirical = torch.bincount(out[:n, 0], minlength=VOCAB).double() / n
        distances.append(float((empirical - p[0].double()).norm()))
    assert distances[0] > distances[1] > distances[2]
    expected = math.sqrt(float((p[0] * (1 - p[0])).sum()) / 100_000)  # E|emp - p|^2 = sum p(1-p)/n
    assert distances[2] < 3 * expected


def test_rejection_happens_and_recovery_is_used(spec_draws):
    """The chain really mixes accepted drafts, recoveries and bonus tokens."""
    _, out = spec_draws
    lengths = (out != PLACEHOLDER_TOKEN_ID).sum(1)
    assert set(lengths.tolist()) == {1, 2, 3}


# --- Reproducibility ---------------------------------------------------------------------------


def test_same_seeds_same_outputs_regardless_of_batch():
    gen = torch.Generator().manual_seed(7)
    vocab, num_reqs = 10, 40
    reqs = []
    for i in range(num_reqs):
        k = i % 4
        reqs.append(dict(
            drafts=torch.randint(0, vocab, (k,), generator=gen).tolist(),
            p=random_probs(k + 1, vocab, gen),
            q=random_probs(k, vocab, gen),
            greedy=i % 5 == 0,
            seed=1000 + i,
            position=int(torch.randint(0, 50, (1,), generator=gen)),
        ))

    def run(order: list[int]) -> dict[int, list[int]]:
        batch = [reqs[i] for i in order]
        out = rejection_sample(
            [r["drafts"] for r in batch],
            torch.cat([r["p"] for r in batch]),
            torch.cat([r["q"] for r in batch]),
            torch.tensor([r["greedy"] for r in batch]),
            [r["seed"] for r in batch],
            [r["position"] for r in batch],
        )
        return {i: row[: len(reqs[i]["drafts"]) + 1] for i, row in zip(order, out.tolist())}

    full = run(list(range(num_reqs)))
    shuffled = torch.randperm(num_reqs, generator=gen).tolist()
    assert run(shuffled) == full
    subset = shuffled[:7]
    assert run(subset) == {i: full[i] for i in subset}
    assert all(run([i]) == {i: full[i]} for i in range(0, num_reqs, 9))
    # Other seeds give other samples.
    for r in reqs:
        r["seed"] += 1
    assert run(list(range(num_reqs))) != full


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_verify_ops_do_not_grow_with_batch_size(with_draft_probs):
    """One batched pass: the same torch ops (on CUDA: launches) for 4 requests as for 64."""

    def count(num_reqs: int) -> list[str]:
        gen = torch.Generator().manual_seed(num_reqs)
        drafts = [torch.randint(0, 10, (i % 4,), generator=gen).tolist() for i in range(num_reqs)]
        total = sum(len(d) for d in drafts)
        target_probs = random_probs(total + num_reqs, 10, gen)
        draft_probs = random_probs(total, 10, gen) if with_draft_probs else None
        greedy = torch.arange(num_reqs) % 3 == 0
        with CountOps() as ops:
            rejection_sample(drafts, target_probs, draft_probs, greedy, list(range(num_reqs)), [0] * num_reqs)
        return ops.names

    assert count(4) == count(64)
