"""Rejection sampler: vLLM output conventions, the greedy rule, and exactness of the probabilistic rule.

Invariant: whatever the drafts, every emitted token is distributed as the target's processed
distribution at its position (checked with a chi-square test over >= 10^5 draws), and a request's
output depends only on its own (seed, position, inputs), never on the rest of the batch.
"""

from __future__ import annotations

import math

import pytest
import torch

import research_lm.ops
from research_lm.api.sampling_params import SamplingParams
from research_lm.engine.request import Request
from research_lm.worker import rng
from research_lm.worker.rejection_sampler import PLACEHOLDER_TOKEN_ID, parse_output, rejection_sample
from research_lm.worker.sampler import Sampler, SamplingBatch, compute_probs, random_sample
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


# --- Drafts on the device: the tensor form with num_valid ---------------------------------------


def device_drafts_case(gen: torch.Generator, num_reqs: int, k_max: int, vocab: int, rows: str, with_q: bool):
    """A tensor-form batch (k_i scheduled slots, the first num_valid[i] of them real drafts, junk after) and
    its list-form twin: the drafts cut to num_valid[i], with their prob rows.

    Junk slots hold -1, an out-of-vocabulary id, or the target's argmax (which a slot read by mistake would
    accept). Rows 0-2 pin the edge cases: num_valid == k_max, == 0 and in between."""
    k = torch.randint(0, k_max + 1, (num_reqs,), generator=gen)
    k[:3] = k_max
    valid = (torch.rand(num_reqs, generator=gen) * (k + 1)).long()  # uniform in 0 .. k_i
    valid[:3] = torch.tensor([k_max, 0, k_max // 2])
    target = random_probs(int(k.sum()) + num_reqs, vocab, gen)
    cu_target = torch.cumsum(k + 1, 0) - (k + 1)
    slot = torch.arange(k_max)
    rows_of = (cu_target[:, None] + slot).clamp(max=len(target) - 1)  # [num_reqs, k_max]: slot j's target row
    best = target.argmax(-1)[rows_of]
    real = torch.where(torch.rand(num_reqs, k_max, generator=gen) < 0.75, best,
                       torch.randint(0, vocab, (num_reqs, k_max), generator=gen))
    junk = torch.stack([torch.full_like(best, -1), torch.full_like(best, vocab + 3), best], -1).gather(
        -1, torch.randint(0, 3, (num_reqs, k_max, 1), generator=gen))[..., 0]
    ids = torch.where(slot < valid[:, None], real, junk)  # [num_reqs, k_max]
    q = None
    if with_q:  # a drafter close to the target: long accepted runs and some rejections
        draft_rows = torch.cat([cu_target[i] + torch.arange(int(k[i])) for i in range(num_reqs)]).long()
        q = 0.5 * target[draft_rows] + 0.5 * random_probs(len(draft_rows), vocab, gen, zero_frac=0.0)
    greedy = {"greedy": torch.ones(num_reqs, dtype=torch.bool), "random": torch.zeros(num_reqs, dtype=torch.bool),
              "mixed": torch.rand(num_reqs, generator=gen) < 0.4}[rows]
    seeds = torch.randint(0, 2**62, (num_reqs,), generator=gen).tolist()
    positions = torch.randint(0, 500, (num_reqs,), generator=gen).tolist()
    tensor_form = dict(draft_token_ids=ids, target_probs=target, draft_probs=q, num_drafts=k.tolist(),
                       num_valid=valid)
    cu_draft = cu_target - torch.arange(num_reqs)
    cut_target = torch.cat([cu_target[i] + torch.arange(int(valid[i]) + 1) for i in range(num_reqs)])
    cut_draft = torch.cat([cu_draft[i] + torch.arange(int(valid[i])) for i in range(num_reqs)]).long()
    list_form = dict(draft_token_ids=[ids[i, : int(valid[i])].tolist() for i in range(num_reqs)],
                     target_probs=target[cut_target], draft_probs=None if q is None else q[cut_draft])
    return tensor_form, list_form, (greedy, seeds, positions)


def in_vocab(form: dict, vocab: int) -> dict:
    """The tensor form with its junk slots mapped into the vocabulary, so every scheduled slot is a draft."""
    return dict(form, draft_token_ids=form["draft_token_ids"].abs() % vocab)


def call(form: dict, shared: tuple, **overrides) -> torch.Tensor:
    kwargs = {**form, **overrides}
    return rejection_sample(kwargs.pop("draft_token_ids"), kwargs.pop("target_probs"), kwargs.pop("draft_probs"),
                            *shared, **kwargs)


def widen(out: torch.Tensor, width: int) -> torch.Tensor:  # pad a list-form output with -1 columns
    return torch.nn.functional.pad(out, (0, width - out.shape[1]), value=PLACEHOLDER_TOKEN_ID)


@pytest.mark.parametrize("with_q", [True, False])
@pytest.mark.parametrize("rows", ["greedy", "random", "mixed"])
@pytest.mark.parametrize("seed", range(3))
def test_device_drafts_with_num_valid_equal_the_list_form_of_the_cut_drafts(seed, rows, with_q):
    gen = torch.Generator().manual_seed(seed)
    k_max = 4
    tensor_form, list_form, shared = device_drafts_case(gen, 40, k_max, 11, rows, with_q)
    if seed == 1:  # the runner's token table is int32
        tensor_form.update(draft_token_ids=tensor_form["draft_token_ids"].int(),
                           num_valid=tensor_form["num_valid"].int())
    got = call(tensor_form, shared)
    assert got.shape == (40, k_max + 1) and got.dtype == torch.int64
    assert torch.equal(got, widen(call(list_form, shared), k_max + 1))
    # The cases that matter occurred: a cut request that took its bonus (n_acc == num_valid < k_i), rejections.
    valid, k = tensor_form["num_valid"].long(), torch.tensor(tensor_form["num_drafts"])
    emitted = (got != PLACEHOLDER_TOKEN_ID).sum(1)
    assert ((emitted == valid + 1) & (valid > 0) & (valid < k)).any()
    assert (emitted < valid + 1).any()


def test_num_valid_none_means_every_scheduled_slot():
    """None, num_valid == num_drafts and a count past it (clamped) give the list form of the uncut drafts;
    a negative count (clamped to 0) gives the zero-draft tokens."""
    gen = torch.Generator().manual_seed(11)
    tensor_form, _, shared = device_drafts_case(gen, 24, 3, 9, "mixed", True)
    k = tensor_form["num_drafts"]
    full = in_vocab(tensor_form, 9)
    uncut = [full["draft_token_ids"][i, : k[i]].tolist() for i in range(24)]
    want = widen(rejection_sample(uncut, full["target_probs"], full["draft_probs"], *shared), 4)
    for num_valid in (None, torch.tensor(k), torch.tensor(k) + 3):
        assert torch.equal(call(full, shared, num_valid=num_valid), want)
    zero = call(full, shared, num_valid=torch.full((24,), -2))
    assert torch.equal(zero, call(full, shared, num_valid=torch.zeros(24, dtype=torch.int64)))
    assert (zero[:, 1:] == PLACEHOLDER_TOKEN_ID).all()


def test_device_drafts_wider_than_every_layout_and_empty_batches():
    """K is the tensor's width even when no request was scheduled that many slots; zero requests or zero
    slots still give [num_reqs, K + 1]."""
    gen = torch.Generator().manual_seed(12)
    target = random_probs(5, 7, gen)
    ids = torch.randint(0, 7, (2, 4), generator=gen)
    out = rejection_sample(ids, target, None, [False, True], [1, 2], [0, 3], num_drafts=[2, 1])
    assert torch.equal(out, widen(rejection_sample([ids[0, :2].tolist(), ids[1, :1].tolist()], target, None,
                                                   [False, True], [1, 2], [0, 3]), 5))
    out = rejection_sample(ids[:, :0], target[:2], None, [False, True], [1, 2], [0, 3], num_drafts=[0, 0],
                           num_valid=torch.zeros(2, dtype=torch.int32))
    assert torch.equal(out, rejection_sample([[], []], target[:2], None, [False, True], [1, 2], [0, 3]))
    empty = rejection_sample(ids[:0], target[:0], None, [], [], [], num_drafts=[],
                             num_valid=torch.zeros(0, dtype=torch.int64))
    assert empty.shape == (0, 5)


def test_bad_device_draft_arguments_name_the_field():
    gen = torch.Generator().manual_seed(13)
    target = random_probs(5, 7, gen)
    ids = torch.zeros(2, 2, dtype=torch.int64)
    shared = ([False, False], [1, 2], [0, 0])
    cases = [
        (dict(draft_token_ids=ids), "num_drafts .* is required"),
        (dict(draft_token_ids=ids.float(), num_drafts=[2, 1]), "draft_token_ids .* int32 or int64"),
        (dict(draft_token_ids=ids[0], num_drafts=[2, 1]), r"draft_token_ids .* \[num_reqs, k_max\]"),
        (dict(draft_token_ids=ids, num_drafts=[3, 0]), "num_drafts must give one count in 0..2"),
        (dict(draft_token_ids=ids, num_drafts=[2]), "num_drafts must give one count"),
        (dict(draft_token_ids=[[0, 0], [0]], num_drafts=[1, 2]), "num_drafts .* differs from the draft lists"),
        (dict(draft_token_ids=ids, num_drafts=[2, 1], num_valid=torch.zeros(3, dtype=torch.int64)),
         r"num_valid must be \[num_reqs\] = \[2\]"),
        (dict(draft_token_ids=ids, num_drafts=[2, 1], num_valid=torch.zeros(2)), "num_valid .* int32 or int64"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            rejection_sample(kwargs.pop("draft_token_ids"), target, None, *shared, **kwargs)


_SYNC_OPS = {"aten._local_scalar_dense.default", "aten.item.default", "aten.nonzero.default", "aten.equal.default",
             "aten.is_nonzero.default"}


@pytest.mark.parametrize("with_q", [True, False])
def test_device_draft_ops_do_not_grow_with_batch_size_and_read_no_device_value(with_q):
    """The same torch ops for 4 requests as for 64, and none that brings a device value to the host (on CPU the
    stand-in for "no host sync": on CUDA, test_device_drafts_on_cuda_never_sync checks the real thing)."""

    def count(num_reqs: int) -> list[str]:
        gen = torch.Generator().manual_seed(num_reqs)
        tensor_form, _, shared = device_drafts_case(gen, num_reqs, 3, 10, "mixed", with_q)
        with CountOps() as ops:
            call(tensor_form, shared)
        return ops.names

    names = count(4)
    assert names == count(64) and not _SYNC_OPS & set(names)


# --- The kernel path with device drafts (Triton interpreter on CPU, tiny shapes) ------------------


@pytest.fixture
def kernel_on_cpu(monkeypatch) -> list[int]:
    """The Triton kernel on CPU tensors too (TRITON_INTERPRET=1 without CUDA: tests/conftest.py), with a 16-column
    block so row scans take several iterations; counts its launches."""
    import research_lm.ops.rejection_kernel as kernel_mod

    monkeypatch.setattr(research_lm.ops, "FUSED_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(kernel_mod, "_MAX_BLOCK", 16)
    calls: list[int] = []
    real = kernel_mod.fused_rejection_sample
    monkeypatch.setattr(kernel_mod, "fused_rejection_sample", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


def torch_path(form: dict, shared: tuple, **overrides) -> torch.Tensor:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(research_lm.ops, "FUSED_DEVICE_TYPES", ())
        return call(form, shared, **overrides)


@pytest.mark.parametrize("with_q", [True, False])
@pytest.mark.parametrize("seed", range(2))
def test_kernel_with_device_drafts_gives_the_list_form_of_the_cut_drafts(seed, with_q, kernel_on_cpu):
    gen = torch.Generator().manual_seed(20 + seed)
    k_max = 3
    tensor_form, list_form, shared = device_drafts_case(gen, 7, k_max, 37, "mixed", with_q)
    if seed == 1:
        tensor_form.update(draft_token_ids=tensor_form["draft_token_ids"].int(),
                           num_valid=tensor_form["num_valid"].int())
    got = call(tensor_form, shared)
    assert kernel_on_cpu
    want = widen(torch_path(list_form, shared), k_max + 1)
    assert torch.equal(got, want) and torch.equal(got, torch_path(tensor_form, shared))
    uncut = in_vocab(tensor_form, 37)  # num_valid=None: every scheduled slot is a draft
    assert torch.equal(call(uncut, shared, num_valid=None), torch_path(uncut, shared, num_valid=None))


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("with_q", [True, False])
def test_device_drafts_on_cuda_never_sync(fused, with_q, monkeypatch):
    """The kernel (fused) and the torch path on CUDA, device drafts and counts, under sync debug mode "error":
    the torch path's list-form tokens for the cut drafts, and no host-device sync in the call."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setattr(research_lm.ops, "FUSED_DEVICE_TYPES", ("cuda",) if fused else ())
    gen = torch.Generator().manual_seed(30)
    k_max, vocab = 5, 128256
    tensor_form, list_form, shared = device_drafts_case(gen, 32, k_max, vocab, "mixed", with_q)
    cuda = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in tensor_form.items()}
    want = widen(torch_path({k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in list_form.items()},
                            shared), k_max + 1)
    call(cuda, shared)  # compiles the kernel outside the checked call
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = call(cuda, shared)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got.cpu(), want.cpu())
