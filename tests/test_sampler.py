"""Sampler: vLLM logit processing, batch-invariant seeded draws, raw logprobs, params validation."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from research_lm.api.sampling_params import SamplingParams
from research_lm.engine.request import Request
from research_lm.worker.sampler import (
    Sampler,
    SamplingBatch,
    SamplingRow,
    TokenHistory,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    compute_probs,
    process_logits,
)

V = 32


def make_req(seed: int = 0, prompt=(1, 2, 3), outputs=(), eos: int | None = None, **sp) -> Request:
    return Request(
        request_id=f"r{seed}",
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(**sp),
        seed=seed,
        eos_token_id=eos,
        output_token_ids=list(outputs),
    )


def sample(logits: torch.Tensor, rows, vocab_size: int | None = None):  # logits [R, V]
    batch = SamplingBatch.build(rows, vocab_size or logits.shape[-1], "cpu")
    return Sampler()(logits, batch), batch


def rand_logits(rows: int, vocab: int = V, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


# ---------------------------------------------------------------------------------------------
# Greedy and seeded sampling
# ---------------------------------------------------------------------------------------------


def test_greedy_is_argmax_of_logits_alone_and_in_mixed_batch():
    logits = rand_logits(6)
    reqs = [make_req(i, temperature=0.0 if i % 2 == 0 else 0.8, top_k=5) for i in range(6)]
    out, batch = sample(logits, reqs)
    greedy = torch.tensor([i % 2 == 0 for i in range(6)])
    assert torch.equal(batch.greedy_mask, greedy)
    assert torch.equal(out.token_ids[greedy], logits.argmax(-1)[greedy])
    out_all, batch_all = sample(logits, [make_req(i, temperature=0.0) for i in range(6)])
    assert batch_all.all_greedy and torch.equal(out_all.token_ids, logits.argmax(-1))
    assert out_all.token_ids.dtype == torch.int64 and out_all.logprobs is None


def test_seeded_token_is_batch_invariant():
    """A row's token depends only on its logits, params, seed and position, not on the batch."""
    target = make_req(1234, temperature=0.9, top_p=0.9, top_k=20, min_p=0.01, outputs=[5, 6])
    own = rand_logits(1, seed=7)[0]  # [V]
    alone = sample(own[None], [target])[0].token_ids[0]
    for n_others, where in [(1, 0), (3, 2), (7, 5), (12, 11)]:
        others = [make_req(s, temperature=[0.0, 0.5, 1.3][s % 3], top_k=s % 6, presence_penalty=0.5,
                           outputs=[s % V])
                  for s in range(n_others)]
        rows = others[:where] + [target] + others[where:]
        logits = rand_logits(len(rows), seed=100 + n_others)
        logits[where] = own
        out, _ = sample(logits, rows)
        assert out.token_ids[where] == alone


def test_different_seeds_and_positions_give_different_draws():
    flat = torch.zeros(1, 1000)  # uniform: any two draws collide with prob 1e-3
    by_seed = {int(sample(flat, [make_req(s)])[0].token_ids[0]) for s in range(20)}
    by_pos = {int(sample(flat, [SamplingRow(make_req(3), [0] * p)])[0].token_ids[0]) for p in range(20)}
    assert len(by_seed) >= 15 and len(by_pos) >= 15
    # Same (seed, position): same token, every time.
    again = {int(sample(flat, [SamplingRow(make_req(3), [0] * 4)])[0].token_ids[0]) for _ in range(3)}
    assert len(again) == 1


def test_verify_rows_match_sequential_single_rows():
    """Spec verification rows (p .. p+k with drafts as history) sample what plain decoding would."""
    req = make_req(9, outputs=[4, 4, 7], temperature=0.7, frequency_penalty=0.4, repetition_penalty=1.3,
                   min_tokens=5, stop_token_ids=[2], eos=1)
    drafts = [4, 1, 9]
    rows = SamplingRow.verify(req, drafts)
    assert [r.position for r in rows] == [3, 4, 5, 6]
    logits = rand_logits(4, seed=3)
    batched, batch = sample(logits, rows)
    assert batch.positions == [3, 4, 5, 6]
    for j in range(4):
        single = make_req(9, outputs=[4, 4, 7] + drafts[:j], temperature=0.7, frequency_penalty=0.4,
                          repetition_penalty=1.3, min_tokens=5, stop_token_ids=[2], eos=1)
        alone, b1 = sample(logits[j : j + 1], [single])
        assert alone.token_ids[0] == batched.token_ids[j]
        assert torch.equal(process_logits(logits[j : j + 1], b1)[0], process_logits(logits, batch)[j])


def test_row_forms_are_equivalent():
    req = make_req(5, outputs=[3], temperature=1.0, presence_penalty=1.0)
    logits = rand_logits(1)
    a = sample(logits, [req])[0].token_ids
    b = sample(logits, [SamplingRow(req)])[0].token_ids
    c = sample(logits, [(req, [3])])[0].token_ids
    assert a == b == c


# ---------------------------------------------------------------------------------------------
# Host work per step
# ---------------------------------------------------------------------------------------------


class CountOps(TorchDispatchMode):
    """Records every aten op (on CUDA: a kernel launch or a copy) run inside the block."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("n", [1, 64])
def test_all_greedy_batch_is_one_argmax_and_builds_no_tensor(n):
    """The common benchmark case: no per-row tensor, no copy, one kernel."""
    reqs = [make_req(i, temperature=0.0, outputs=[1, 2], max_tokens=9) for i in range(n)]
    logits = rand_logits(n)
    with CountOps() as ops:
        batch = SamplingBatch.build(reqs, V)
        out = Sampler()(logits, batch)
    assert ops.names == ["aten.argmax.default"]
    assert torch.equal(out.token_ids, logits.argmax(-1))
    fields = ("temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
              "repetition_penalty", "output_counts", "seen_mask", "banned_rows", "banned_token_ids")
    assert all(getattr(batch, f) is None for f in fields)
    assert torch.equal(compute_probs(logits, batch), torch.nn.functional.one_hot(logits.argmax(-1), V).float())


def test_sampling_ops_do_not_grow_with_batch_size():
    """Seeded rows, every feature on: the same ops at batch 4 and 64 (no per-row generators or copies)."""

    def count(n: int) -> list[str]:
        reqs = [make_req(i, temperature=0.0 if i % 2 else 0.7, top_k=5, top_p=0.9, min_p=0.01, logprobs=2,
                         presence_penalty=0.2, repetition_penalty=1.1, min_tokens=3, stop_token_ids=[4],
                         outputs=[i % V]) for i in range(n)]
        with CountOps() as ops:
            Sampler()(rand_logits(n), SamplingBatch.build(reqs, V))
        return ops.names

    assert count(4) == count(64)
    # Temperature 1 everywhere: no temperature tensor and no division.
    batch = SamplingBatch.build([make_req(i, top_p=0.5) for i in range(3)], V)
    assert batch.temperature is None and batch.top_p is not None and batch.top_k is None


# ---------------------------------------------------------------------------------------------
# Truncation: allowed sets and empirical distributions
# ---------------------------------------------------------------------------------------------


def reference_truncated(logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float):
    """Hand-written, loop-based reference: temperature -> min_p -> top-k -> top-p, renormalised."""
    z = [x / temperature for x in logits]
    m = max(z)
    w = [math.exp(x - m) for x in z]
    keep = [wi >= min_p * 1.0 for wi in w]  # w_max == 1
    order = sorted(range(len(z)), key=lambda i: -z[i])
    if top_k > 0:
        kth = z[order[top_k - 1]]
        keep = [k and z[i] >= kth for i, k in enumerate(keep)]
    total = sum(w[i] for i in range(len(z)) if keep[i])
    cum, cutoff = 0.0, None
    for i in order:
        if not keep[i]:
            continue
        cutoff = z[i]
        cum += w[i] / total
        if cum >= top_p:
            break
    keep = [k and z[i] >= cutoff for i, k in enumerate(keep)]
    total = sum(w[i] for i in range(len(z)) if keep[i])
    return [w[i] / total if keep[i] else 0.0 for i in range(len(z))]


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=4),
        dict(temperature=1.0, top_p=0.6),
        dict(temperature=1.2, min_p=0.15),
        dict(temperature=0.8, top_k=6, top_p=0.8, min_p=0.05),
    ],
    ids=["plain", "top_k", "top_p", "min_p", "all"],
)
def test_truncated_sampling_matches_reference_distribution(params):
    vocab, n = 12, 6000
    row = torch.tensor([2.0, 1.5, 1.4, 1.0, 0.8, 0.5, 0.1, 0.0, -0.3, -0.5, -1.0, -2.0])
    ref = torch.tensor(reference_truncated(row.tolist(), params["temperature"], params.get("top_k", 0),
                                           params.get("top_p", 1.0), params.get("min_p", 0.0)))
    reqs = [make_req(s, **params) for s in range(n)]
    out, batch = sample(row.expand(n, vocab), reqs)
    assert torch.allclose(compute_probs(row[None], SamplingBatch.build(reqs[:1], vocab))[0], ref, atol=1e-5)
    counts = torch.bincount(out.token_ids, minlength=vocab).double()
    assert counts[ref == 0].sum() == 0, "sampled a token outside the allowed set"
    allowed = ref > 0
    expected = ref[allowed].double() * n
    chi2 = ((counts[allowed] - expected) ** 2 / expected).sum().item()
    df = int(allowed.sum()) - 1
    # Far looser than any plausible quantile (mean df, sd sqrt(2 df)); catches a wrong distribution.
    assert chi2 < df + 6 * math.sqrt(2 * max(df, 1)) + 6, (chi2, df)
    assert (counts / n - ref.double()).abs().max() < 0.03


def test_top_k_top_p_sets_and_ties():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0, 2.0]])
    neg = float("-inf")
    # top-k 2: the 2nd largest is 2.0, tied three ways: all ties at the boundary are kept.
    out = apply_top_k_top_p(logits, torch.tensor([2]), None)
    assert torch.equal(out, torch.tensor([[3.0, neg, 2.0, 2.0, neg, 2.0]]))
    out = apply_top_k_top_p(logits, torch.tensor([1]), None)
    assert torch.equal(out.isfinite(), torch.tensor([[True] + [False] * 5]))
    # top-p tiny: always at least one token.
    out = apply_top_k_top_p(logits, None, torch.tensor([1e-6]))
    assert out.isfinite().sum() == 1 and out[0, 0] == 3.0
    # top-p exactly reached by a prefix: p = p0 keeps only token 0; slightly more adds the tie group.
    p = logits.softmax(-1)[0]
    out = apply_top_k_top_p(logits, None, torch.tensor([float(p[0]) * 0.999]))
    assert out.isfinite().sum() == 1
    out = apply_top_k_top_p(logits, None, torch.tensor([float(p[0]) + 1e-3]))
    assert torch.equal(out.isfinite(), torch.tensor([[True, False, True, True, False, True]]))
    # Disabled rows (k = 0 or V, p = 1) are untouched, next to an active row; input not modified.
    two = torch.randn(3, 50)
    before = two.clone()
    out = apply_top_k_top_p(two, torch.tensor([0, 50, 3]), torch.tensor([1.0, 1.0, 1.0]))
    assert torch.equal(out[:2], two[:2]) and out[2].isfinite().sum() == 3
    assert torch.equal(two, before)


def test_min_p_threshold():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]]))
    out = apply_min_p(logits, torch.tensor([0.15]))  # keep prob >= 0.075
    assert torch.equal(out.isfinite(), torch.tensor([[True, True, True, False, False]]))
    assert torch.equal(apply_min_p(logits, torch.tensor([0.0])), logits)


# ---------------------------------------------------------------------------------------------
# Penalties and min_tokens
# ---------------------------------------------------------------------------------------------


def reference_penalties(logits, prompt, outputs, presence, frequency, repetition):
    out = list(logits)
    seen = set(prompt) | set(outputs)
    for t in range(len(out)):
        if t in seen:
            out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
        c = outputs.count(t)
        out[t] -= frequency * c
        out[t] -= presence * (1.0 if c > 0 else 0.0)
    return out


def test_penalties_match_reference():
    vocab = 10
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5, -0.5, 0.0, 3.0, -2.0, 1.5, 0.2]] * 3)
    cases = [
        dict(prompt=[0, 1, 1], outputs=[2, 2, 4, 9], presence_penalty=0.5, frequency_penalty=0.25,
             repetition_penalty=1.5),
        dict(prompt=[6], outputs=[6, 7, 7, 7], presence_penalty=-0.3, frequency_penalty=1.0,
             repetition_penalty=0.8),
        dict(prompt=[3], outputs=[5], temperature=0.0),  # no penalties in this row
    ]
    reqs = [make_req(i, **c) for i, c in enumerate(cases)]
    batch = SamplingBatch.build(reqs, vocab)
    assert batch.output_counts is not None and batch.seen_mask is not None
    out = apply_penalties(logits, batch.output_counts, batch.seen_mask, batch.presence_penalty,
                          batch.frequency_penalty, batch.repetition_penalty)
    for i, c in enumerate(cases):
        ref = reference_penalties(logits[i].tolist(), c["prompt"], c["outputs"],
                                  c.get("presence_penalty", 0.0), c.get("frequency_penalty", 0.0),
                                  c.get("repetition_penalty", 1.0))
        assert torch.allclose(out[i], torch.tensor(ref), atol=1e-6), i
    # Greedy rows use penalised logits too.
    greedy = make_req(0, prompt=[6], outputs=[], temperature=0.0, repetition_penalty=10.0)
    tok = sample(logits[:1], [greedy])[0].token_ids[0]
    assert tok == 2  # token 6 (logit 3.0) is divided by 10


@pytest.mark.parametrize("rows, argmax_only", [
    ([dict(), dict(outputs=[1])], True),
    ([dict(min_tokens=2, stop_token_ids=[4], outputs=[4, 4])], True),  # min_tokens reached
    ([dict(min_tokens=2, ignore_eos=True)], True),  # below min_tokens with nothing to ban
    ([dict(), dict(temperature=0.7)], False),
    ([dict(logprobs=0)], False),
    # below: the raw argmax (token 4) is not the greedy token
    ([dict(repetition_penalty=1.2)], False),
    ([dict(), dict(presence_penalty=1.0, outputs=[4])], False),
    ([dict(frequency_penalty=1.0, outputs=[4])], False),
    ([dict(min_tokens=2, stop_token_ids=[4], ignore_eos=True, outputs=[4])], False),
    ([dict(logit_bias={9: 1.0})], False),
    ([dict(), dict(allowed_token_ids=[9, 11])], False),
])
def test_argmax_only_says_when_the_sampler_is_the_raw_argmax(rows, argmax_only):
    """A precomputed argmax (the decode CUDA graph's) may stand in for the sampler exactly when
    `argmax_only`; whenever it says so, the sampler's tokens are argmax(raw logits)."""
    reqs = [make_req(i, prompt=(3, 4, 5, 6), eos=4, **{"temperature": 0.0, **r}) for i, r in enumerate(rows)]
    logits = rand_logits(len(reqs), seed=3, scale=0.1)
    logits[:, 4], logits[:, 9] = 10.0, 9.5  # token 4: in the prompt, the stop id and EOS
    out, batch = sample(logits, reqs)
    assert batch.argmax_only is argmax_only
    if argmax_only:
        assert torch.equal(out.token_ids, logits.argmax(-1)) and out.logprobs is None
    elif all(r.sampling_params.greedy and r.sampling_params.logprobs is None for r in reqs):
        assert 9 in out.token_ids.tolist()  # the penalty or the ban moved a row off the raw argmax


def test_logit_bias_and_allowed_token_ids_follow_vllm():
    """allowed_token_ids masks every other token before the bias (a biased token outside the allowed set stays
    out); logit_bias adds to the raw logit; other rows of the batch are untouched."""
    logits = rand_logits(3, seed=7)
    reqs = [make_req(0, temperature=0.0, logit_bias={5: 100.0}),
            make_req(1, temperature=0.0, allowed_token_ids=[2, 6, 30], logit_bias={7: 100.0, 6: 0.5}),
            make_req(2, temperature=0.0)]
    batch = SamplingBatch.build(reqs, V)
    processed = process_logits(logits, batch)
    assert processed[0, 5] == logits[0, 5] + 100.0 and torch.equal(processed[0, :5], logits[0, :5])
    allowed = torch.full((V,), float("-inf"))
    allowed[[2, 6, 30]] = logits[1, [2, 6, 30]]
    allowed[6] += 0.5
    assert torch.equal(processed[1], allowed)
    assert torch.equal(processed[2], logits[2])
    out, _ = sample(logits, reqs)
    assert out.token_ids.tolist() == [5, int(allowed.argmax()), int(logits[2].argmax())]
    sampled = [make_req(s, temperature=1.5, allowed_token_ids=[1, 3]) for s in range(64)]
    assert set(sample(rand_logits(64, seed=1), sampled)[0].token_ids.tolist()) == {1, 3}


def test_no_penalty_fast_path_builds_no_tensors():
    batch = SamplingBatch.build([make_req(i, outputs=[1, 2]) for i in range(3)], V)
    assert batch.output_counts is None and batch.seen_mask is None and batch.no_penalties
    batch = SamplingBatch.build([make_req(0, presence_penalty=0.1), make_req(1)], V)
    assert batch.output_counts is not None and batch.seen_mask is None


def test_min_tokens_bans_eos_and_stop_ids():
    vocab = 8
    logits = torch.full((1, vocab), -5.0)
    logits[0, 1] = 10.0  # EOS
    logits[0, 3] = 9.0  # stop id
    logits[0, 5] = 8.0
    base = dict(min_tokens=2, stop_token_ids=[3], temperature=0.0)
    assert sample(logits, [make_req(0, eos=1, **base)])[0].token_ids[0] == 5
    assert sample(logits, [make_req(0, eos=1, outputs=[0], **base)])[0].token_ids[0] == 5
    assert sample(logits, [make_req(0, eos=1, outputs=[0, 0], **base)])[0].token_ids[0] == 1  # reached
    assert sample(logits, [make_req(0, eos=1, ignore_eos=True, **base)])[0].token_ids[0] == 1
    # Random rows: banned ids are never drawn.
    reqs = [make_req(s, eos=1, min_tokens=1, stop_token_ids=[3], temperature=5.0) for s in range(300)]
    toks = sample(logits.expand(300, vocab), reqs)[0].token_ids
    assert not ((toks == 1) | (toks == 3)).any()
    # Verify rows: the drafts count as outputs.
    rows = SamplingRow.verify(make_req(0, eos=1, **base), [0, 0])
    assert sample(logits.expand(3, vocab), rows)[0].token_ids.tolist() == [5, 5, 1]


# ---------------------------------------------------------------------------------------------
# Penalties read from the device token table (TokenHistory)
# ---------------------------------------------------------------------------------------------


def history_of(rows: list[SamplingRow], width: int = 24, seed: int = 0, device="cpu") -> TokenHistory:
    """A table holding each row's request at a scattered table row, as the runner's does: prompt, outputs, then the
    drafts its rows follow; every other cell is junk (tokens in and out of the vocabulary) that must not be read."""
    requests = list({id(r.request): r.request for r in rows})
    where = {key: 2 * (len(requests) - k) - 1 for k, key in enumerate(requests)}  # not the batch order
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(-V, V, (2 * len(requests) + 1, width), generator=g, dtype=torch.int32)
    for r in rows:  # a request's longest `then` holds all its rows' drafts
        tokens = r.request.prompt_token_ids + r.outputs
        table[where[id(r.request)], : len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
    return TokenHistory(table.to(device), [where[id(r.request)] for r in rows],
                        [r.request.num_prompt_tokens for r in rows],
                        [r.request.num_prompt_tokens + len(r.outputs) for r in rows])


def penalty_rows() -> list[SamplingRow]:
    """Every penalty alone and together, rows using none in between, and verify rows (one table row, growing
    ends), greedy and random."""
    reqs = [
        make_req(0, prompt=[1, 2, 2], outputs=[5, 5, 7], temperature=0.8, presence_penalty=1.5),
        make_req(1, outputs=[3], temperature=0.0),  # no penalty
        make_req(2, prompt=[9], outputs=[9, 4, 4, 4], frequency_penalty=0.7, temperature=0.9),
        make_req(3, prompt=[6, 1], outputs=[], repetition_penalty=1.8, temperature=0.0),
        make_req(4, prompt=[8, 8], outputs=[2, 8], temperature=1.1, top_k=6, presence_penalty=-0.4,
                 frequency_penalty=0.5, repetition_penalty=0.7),
        make_req(5, prompt=[10] * 20, outputs=[], temperature=0.0, repetition_penalty=1.2),  # a long prompt
    ]
    verify = make_req(6, prompt=[3, 4], outputs=[4, 11], temperature=0.7, frequency_penalty=0.9,
                      repetition_penalty=1.4)
    return [SamplingRow(r) for r in reqs[:3]] + SamplingRow.verify(verify, [11, 4, 12]) + [
        SamplingRow(r) for r in reqs[3:]]


@pytest.mark.parametrize("keep", [None, "presence_penalty", "frequency_penalty", "repetition_penalty"])
def test_history_table_gives_the_host_lists_penalty_state(keep):
    """The same tokens in the device table as in the host lists: the same output_counts, seen_mask, processed
    logits and sampled tokens (keep: only that penalty stays on, the others off)."""
    rows = penalty_rows()
    if keep is not None:
        off = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
        for r in {id(r.request): r.request for r in rows}.values():
            sp = vars(r.sampling_params) | {k: v for k, v in off.items() if k != keep}
            r.sampling_params = SamplingParams(**sp)
    logits = rand_logits(len(rows), seed=4)
    host = SamplingBatch.build(rows, V)
    table = SamplingBatch.build(rows, V, history=history_of(rows))
    assert host.output_counts is not None or host.seen_mask is not None
    for name in ("output_counts", "seen_mask"):
        a, b = getattr(host, name), getattr(table, name)
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), name
    assert torch.equal(process_logits(logits, host), process_logits(logits, table))
    assert torch.equal(Sampler()(logits, host).token_ids, Sampler()(logits, table).token_ids)
    if keep is None:  # the rows without a penalty read nothing; the verify rows read their own drafts
        assert not host.output_counts[1].any() and not host.seen_mask[:3].any()
        assert host.output_counts[3:7, 4].tolist() == [1.0, 1.0, 2.0, 2.0]


def test_history_counts_outputs_still_in_flight():
    """Under async scheduling the host knows a count, not the values, of the outputs in flight: positions count
    them (noise, min_tokens) and penalties read their values from the table; the result is what the host path
    gives once the values are known."""
    known = make_req(3, prompt=[1, 2], outputs=[5, 9, 9], temperature=0.9, frequency_penalty=0.8,
                     repetition_penalty=1.3, min_tokens=3, stop_token_ids=[7], eos=6)
    flying = make_req(3, prompt=[1, 2], outputs=[5], temperature=0.9, frequency_penalty=0.8,
                      repetition_penalty=1.3, min_tokens=3, stop_token_ids=[7], eos=6)
    flying.num_output_placeholders = 2
    assert SamplingRow(flying).position == 3 and SamplingRow(flying, then=[4]).position == 4
    assert SamplingRow(flying, [8], then=[4, 4]).position == 3  # an explicit list counts itself
    assert [r.position for r in SamplingRow.verify(flying, [4, 9])] == [3, 4, 5]
    history = history_of(SamplingRow.verify(known, [9, 4]))  # the table holds what the host does not know
    assert history.ends == [5, 6, 7]
    logits = rand_logits(3, seed=8)
    logits[:, 6:8] += 4.0  # EOS and the stop id: drawn often unless min_tokens bans them
    want = SamplingBatch.build(SamplingRow.verify(known, [9, 4]), V)
    got = SamplingBatch.build(SamplingRow.verify(flying, [9, 4]), V, history=history)
    assert want.positions == got.positions == [3, 4, 5] and got.banned_rows is None
    assert torch.equal(want.output_counts, got.output_counts) and torch.equal(want.seen_mask, got.seen_mask)
    assert got.output_counts[:, 9].tolist() == [2.0, 3.0, 3.0]
    assert torch.equal(Sampler()(logits, want).token_ids, Sampler()(logits, got).token_ids)


def test_history_build_is_batched_device_ops_without_a_sync():
    """With a table, building the penalty state never reads a device value on the host (no item / nonzero) and
    runs the same ops at 4 and 64 rows: no Python per row over tokens."""

    def ops(n: int) -> list[str]:
        reqs = [make_req(i, prompt=list(range(1, 2 + i % 5)), outputs=[i % V] * (i % 3), presence_penalty=0.3,
                         repetition_penalty=1.2 if i % 2 else 1.0) for i in range(n)]
        history = history_of([SamplingRow(r) for r in reqs], seed=n)
        with CountOps() as counted:
            SamplingBatch.build(reqs, V, history=history)
        return counted.names

    names = ops(4)
    assert names == ops(64)
    waits = ("_local_scalar_dense", "item", "nonzero", "masked_select", "unique")  # a value or a shape from the device
    assert not [n for n in names if any(w in n for w in waits)]


@pytest.mark.gpu
def test_history_on_cuda_matches_the_host_lists_without_a_sync():
    """The table path on CUDA: the host path's state and tokens, and building it never waits for the device."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    rows = penalty_rows()
    logits = rand_logits(len(rows), seed=4)
    host = SamplingBatch.build(rows, V)
    history = history_of(rows, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        table = SamplingBatch.build(rows, V, "cuda", history=history)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(host.output_counts, table.output_counts.cpu())
    assert torch.equal(host.seen_mask, table.seen_mask.cpu())
    assert torch.equal(Sampler()(logits, host).token_ids, Sampler()(logits.cuda(), table).token_ids.cpu())


def test_history_must_give_every_batch_row():
    rows = [SamplingRow(make_req(0, presence_penalty=1.0)), SamplingRow(make_req(1))]
    history = history_of(rows)
    history.ends = history.ends[:1]
    with pytest.raises(ValueError, match=r"history\.ends has 1 entries for 2 rows"):
        SamplingBatch.build(rows, V, history=history)


# ---------------------------------------------------------------------------------------------
# Logprobs
# ---------------------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_with_correct_ranks():
    logits = rand_logits(4, seed=11)
    logits[3, :4] = logits[3].max() + 1.0  # a 4-way tie at the top
    reqs = [
        make_req(0, logprobs=3, temperature=0.5, repetition_penalty=1.7, top_k=3, outputs=[1, 2]),
        make_req(1, logprobs=None),
        make_req(2, logprobs=0, temperature=0.0, presence_penalty=2.0, outputs=[int(logits[2].argmax())]),
        make_req(3, logprobs=5, temperature=0.0),
    ]
    out, batch = sample(logits, reqs)
    assert batch.max_num_logprobs == 5
    ref = torch.log_softmax(logits, dim=-1)
    lp = out.logprobs
    tok = out.token_ids
    assert torch.allclose(lp.sampled_logprobs, ref.gather(1, tok[:, None])[:, 0])
    for i in range(4):
        rank = 1 + int((ref[i] > ref[i, tok[i]]).sum())
        assert int(lp.sampled_ranks[i]) == rank
    assert torch.allclose(lp.topk_logprobs, ref.topk(5, dim=-1).values)
    dicts = out.logprob_dicts(batch)
    assert dicts[1] is None
    assert set(dicts[2]) == {int(tok[2])}  # logprobs=0: only the sampled token
    assert dicts[2][int(tok[2])].rank > 1  # the presence penalty pushed it off the raw argmax
    assert len(dicts[0]) in (3, 4) and int(tok[0]) in dicts[0]
    for i in (0, 2, 3):
        for t, entry in dicts[i].items():
            assert entry.logprob == pytest.approx(float(ref[i, t]), abs=1e-6)
            assert entry.rank == 1 + int((ref[i] > ref[i, t]).sum())
    # The tied top tokens all share rank 1.
    assert [dicts[3][t].rank for t in range(4)] == [1, 1, 1, 1]
    assert dicts[3][int(tok[3])].rank == 1 and int(tok[3]) == 0  # greedy ties: first index


def test_no_logprobs_requested():
    out, batch = sample(rand_logits(2), [make_req(0), make_req(1)])
    assert out.logprobs is None and batch.max_num_logprobs is None
    assert out.logprob_dicts(batch) == [None, None]


def test_compute_probs_greedy_one_hot_and_random_normalised():
    logits = rand_logits(3, seed=5)
    reqs = [make_req(0, temperature=0.0), make_req(1, top_k=3), make_req(2, top_p=0.5)]
    batch = SamplingBatch.build(reqs, V)
    probs = compute_probs(logits, batch)
    assert torch.equal(probs[0], torch.nn.functional.one_hot(logits[0].argmax(), V).float())
    assert torch.allclose(probs.sum(-1), torch.ones(3))
    assert int((probs[1] > 0).sum()) == 3
    tok = Sampler()(logits, batch).token_ids
    assert (probs.gather(1, tok[:, None]) > 0).all()


# ---------------------------------------------------------------------------------------------
# SamplingParams validation (at the edge)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("temperature", -0.1),
        ("top_k", -2),
        ("min_p", 1.5),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0.0),
        ("min_tokens", -1),
        ("logprobs", -1),
        ("stop_token_ids", [-1]),
        ("max_tokens", 0),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {3: float("inf")}),
        ("allowed_token_ids", []),
        ("allowed_token_ids", [-2]),
    ],
)
def test_sampling_params_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.gpu
def test_cuda_samples_the_same_tokens_as_cpu():
    """Counter-based noise is device-independent, so seeded rows pick the same tokens on CUDA."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    reqs = [make_req(i, temperature=[0.0, 0.7, 1.0][i % 3], top_k=[0, 8][i % 2], top_p=0.95, logprobs=2,
                     presence_penalty=0.2, min_tokens=2, stop_token_ids=[4], outputs=[i % V],
                     **([{}, {"logit_bias": {1: 5.0, 7: -100.0}}, {"allowed_token_ids": [2, 5, 9, 11]}][i % 3]))
            for i in range(64)]
    logits = rand_logits(64)
    cpu = Sampler()(logits, SamplingBatch.build(reqs, V, "cpu"))
    cuda = Sampler()(logits.cuda(), SamplingBatch.build(reqs, V, "cuda"))
    assert cuda.token_ids.device.type == "cuda"
    assert torch.equal(cuda.token_ids.cpu(), cpu.token_ids)
    assert set(cuda.token_ids[2::3].tolist()) <= {2, 5, 9, 11}  # allowed_token_ids holds on the device too
