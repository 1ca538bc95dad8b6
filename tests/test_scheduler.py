"""Scheduler: token budget, chunked prefill, preemption by recompute, prefix caching, stops, drafts.

No model: `FakeRunner` keeps a fake KV memory (one prefix hash per token slot), checks that every
position a query reads holds the right prefix, and "samples" the next token as a hash of the KV it
read. So each request's tokens are a pure function of its prompt, like a greedy model's, and
`reference_output` computes them without any scheduler: a lost, duplicated or misplaced token, a
block shared by mistake or a wrong `num_computed_tokens` changes the output or trips an assert.
Drafts come from a proposer that knows the true continuation and corrupts some of it, so the
verification accepts a random prefix.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from research_lm.api.outputs import RunnerOutput, SchedulerOutput
from research_lm.api.sampling_params import SamplingParams
from research_lm.engine.kv_cache import NULL_BLOCK_ID, KVCacheManager
from research_lm.engine.request import Logprob, Request, RequestStatus
from research_lm.engine.scheduler import Scheduler
from tests.test_kv_cache import assert_kv_invariants

VOCAB = 24
_ROOT = 17


def chain_step(h: int, token: int) -> int:
    return hash((h, token))


def model_next(seed: int, prefix_hash: int) -> int:
    """The fake model: the token after a prefix, a function of (seed, prefix) only."""
    return hash((seed, prefix_hash, 0xABC)) % VOCAB


def prefix_chain(tokens: list[int]) -> list[int]:
    chain, h = [], _ROOT
    for t in tokens:
        h = chain_step(h, t)
        chain.append(h)
    return chain


def reference_output(req: Request, max_model_len: int) -> tuple[list[int], str, int | None]:
    """What the request must produce: sample greedily from the fake model and apply vLLM's stops."""
    p = req.sampling_params
    h, out = prefix_chain(req.prompt_token_ids)[-1], []
    while True:
        t = model_next(req.seed, h)
        out.append(t)
        h = chain_step(h, t)
        if len(out) >= p.min_tokens:
            if t == req.eos_token_id and not p.ignore_eos:
                return out, "stop", None
            if t in p.stop_token_ids:
                return out, "stop", t
        if (p.max_tokens is not None and len(out) >= p.max_tokens) or len(req.prompt_token_ids) + len(
            out
        ) >= max_model_len:
            return out, "length", None


class FakeRunner:
    """Writes each scheduled token's prefix hash into its slot, verifies every slot a query reads,
    samples from what it read, verifies drafts greedily and proposes the next drafts."""

    def __init__(self, kv: KVCacheManager, *, num_spec: int = 0, p_wrong: float = 0.0, seed: int = 0,
                 sliding_window: int | None = None) -> None:
        self.pool = kv.pool
        self.bs = kv.block_size
        self.num_spec = num_spec
        self.p_wrong = p_wrong
        self.rng = random.Random(seed)
        self.window = sliding_window
        self.memory: dict[tuple[int, int], int] = {}
        self.rows: set[str] = set()  # requests the runner holds state for
        self.drafts: dict[str, list[int]] = {}  # the runner keeps draft values; the scheduler only counts them
        self.num_prefill_chunks_without_output = 0

    def _slot(self, block_ids: list[int], pos: int) -> tuple[int, int]:
        block_id = block_ids[pos // self.bs]
        assert block_id != NULL_BLOCK_ID, f"position {pos} maps to the null block"
        return block_id, pos % self.bs

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        self.rows -= so.finished_req_ids | so.preempted_req_ids
        sampled, logprobs, proposed = [], [], {}
        for s in so.scheduled:
            req = s.request
            assert req.status == RequestStatus.RUNNING and s.num_new_tokens >= 1
            if req.request_id not in self.rows:  # (re)admitted: starts from its prefix hits
                assert req.num_computed_tokens % self.bs == 0 and not s.num_spec_tokens
                self.rows.add(req.request_id)
            spec = self.drafts.pop(req.request_id, [])[: s.num_spec_tokens]
            assert len(spec) == s.num_spec_tokens
            toks = self._run_one(req, s.num_new_tokens, s.block_ids, spec)
            sampled.append(toks)
            logprobs.append([{t: Logprob(-1.0, 1)} for t in toks])
            if toks and self.num_spec:
                self.drafts[req.request_id] = self._propose(req, toks)
                proposed[req.request_id] = self.num_spec
        return RunnerOutput([s.request.request_id for s in so.scheduled], sampled, logprobs,
                            [s.num_spec_tokens for s in so.scheduled], proposed)

    def _run_one(self, req: Request, num_new: int, block_ids: list[int], spec: list[int]) -> list[int]:
        start, end = req.num_computed_tokens, req.num_computed_tokens + num_new
        tokens = req.all_token_ids + spec
        assert end <= len(tokens) and len(tokens) - req.num_tokens == len(spec)
        assert end >= req.num_tokens or not spec, "drafts only ride on a step that reaches them"
        chain = prefix_chain(tokens[:end])
        for p in range(start, end):
            slot = self._slot(block_ids, p)
            block = self.pool.blocks[slot[0]]  # cached or shared KV is frozen: never written again
            assert block.ref_cnt == 1 and block.block_hash is None, (req.request_id, p, block)
            self.memory[slot] = chain[p]
        lo = 0 if self.window is None else max(0, start - self.window + 1)
        for p in range(lo, end):  # everything the step's queries attend to
            assert self.memory[self._slot(block_ids, p)] == chain[p], (req.request_id, p)
        if end < req.num_tokens:
            self.num_prefill_chunks_without_output += 1
            return []
        out = []
        for j in range(len(spec) + 1):  # greedy verification: accept while the target agrees
            t = model_next(req.seed, self.memory[self._slot(block_ids, req.num_tokens - 1 + j)])
            out.append(t)
            if j == len(spec) or spec[j] != t:
                break
        return out

    def _propose(self, req: Request, emitted: list[int]) -> list[int]:
        h = prefix_chain(req.all_token_ids + emitted)[-1]
        drafts = []
        for _ in range(self.num_spec):
            t = model_next(req.seed, h)
            if self.rng.random() < self.p_wrong:
                t = (t + 1) % VOCAB
            drafts.append(t)
            h = chain_step(h, t)
        return drafts


def make_request(i: int, prompt: list[int], *, eos: int | None = None, **params) -> Request:
    return Request(f"r{i}", list(prompt), SamplingParams(**params), seed=1000 + i, eos_token_id=eos)


def check_step(sched: Scheduler, so: SchedulerOutput, running_before: list[str]) -> None:
    """Per-step invariants of one `schedule()` call."""
    assert so.num_scheduled_tokens <= sched.max_num_batched_tokens
    assert len(sched.running) <= sched.max_num_seqs
    assert all(s.num_new_tokens >= 1 for s in so.scheduled)
    ids = [s.request.request_id for s in so.scheduled]
    assert len(ids) == len(set(ids))
    assert not (set(ids) & so.preempted_req_ids)
    # Running requests first, in admission order; preempted ones are the newest (a suffix).
    num_old = sum(i in running_before for i in ids)
    assert ids[:num_old] == running_before[:num_old]
    if so.preempted_req_ids:
        assert num_old == len(ids), "no admission in a step that preempts"
        k = len(so.preempted_req_ids)
        assert set(running_before[-k:]) == so.preempted_req_ids
    assert [r.request_id for r in sched.running] == ids[:num_old] + [
        i for i in running_before[num_old:] if i not in so.preempted_req_ids
    ] + ids[num_old:]
    for s in so.scheduled:
        req = s.request
        assert s.block_ids == sched.kv_cache.get_block_ids(req.request_id)
        assert len(s.block_ids) * sched.kv_cache.block_size >= req.num_computed_tokens + s.num_new_tokens
        assert req.num_tokens + s.num_spec_tokens <= sched.max_model_len
        assert s.num_spec_tokens == req.num_spec_tokens


def run_to_completion(sched: Scheduler, runner: FakeRunner, arrivals: list[tuple[int, Request]],
                      aborts: list[tuple[int, str]] = (), max_steps: int = 5000) -> dict[str, Request]:
    """Drive schedule -> execute -> update until every request finished, checking invariants."""
    pending = sorted(arrivals, key=lambda a: a[0])
    pending_aborts = sorted(aborts)
    all_reqs = {r.request_id: r for _, r in arrivals}
    step = 0
    while pending or sched.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            sched.add_request(pending.pop(0)[1])
        while pending_aborts and pending_aborts[0][0] <= step:
            sched.abort_request(pending_aborts.pop(0)[1])
        running_before = [r.request_id for r in sched.running]
        so = sched.schedule()
        check_step(sched, so, running_before)
        live = {r.request_id: r for r in sched.running}
        assert_kv_invariants(sched.kv_cache, live)
        if sched.has_unfinished_requests():
            assert so.scheduled, "no progress with unfinished requests"
        ro = runner.execute(so)
        assert runner.rows == set(live)
        finished = sched.update_from_output(so, ro)
        assert all(r.is_finished and r.finish_reason in ("stop", "length") for r in finished)
        assert_kv_invariants(sched.kv_cache, {r.request_id: r for r in sched.running})
        step += 1
        assert step < max_steps
    runner.execute(sched.schedule())  # deliver the last finished ids
    assert not runner.rows
    kv = sched.kv_cache
    assert kv.num_free_blocks == kv.num_blocks - 1 and all(b.ref_cnt == 0 for b in kv.pool.blocks)
    return all_reqs


def assert_matches_reference(reqs: dict[str, Request], max_model_len: int, aborted: set[str] = ()) -> None:
    for req in reqs.values():
        tokens, reason, stop_reason = reference_output(req, max_model_len)
        assert req.is_finished and req.finish_time is not None
        assert len(req.output_logprobs) == req.num_output_tokens
        if req.request_id in aborted and req.finish_reason == "abort":
            assert req.output_token_ids == tokens[: req.num_output_tokens]
            continue
        assert req.output_token_ids == tokens, req.request_id
        assert (req.finish_reason, req.stop_reason) == (reason, stop_reason)
        assert req.first_token_time is not None
        assert req.num_accepted_tokens <= req.num_draft_tokens


# ---- property test ------------------------------------------------------------------------------


@st.composite
def workloads(draw, pressure: bool = False):
    """Random engine settings and requests. `pressure`: many long requests at once on a pool just
    big enough for one, with shared prefixes, so preemptions and prefix hits are the norm."""
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.integers(8, 48))
    chunked = draw(st.booleans())
    min_blocks = -(-max_model_len // block_size) + 1
    num_blocks = draw(st.integers(min_blocks, min_blocks + (3 if pressure else 12)))
    min_budget = 1 if chunked else max_model_len
    budget = draw(st.integers(min_budget, max(min_budget, 24)))
    base = draw(st.lists(st.integers(0, VOCAB - 1), min_size=max_model_len // 2 if pressure else 0,
                         max_size=max_model_len))
    num_reqs = draw(st.integers(4, 8) if pressure else st.integers(1, 8))
    arrivals = []
    for i in range(num_reqs):
        keep = draw(st.integers(0, len(base)))
        tail_len = draw(st.integers(0, max_model_len - keep))
        tail = draw(st.lists(st.integers(0, VOCAB - 1), min_size=tail_len, max_size=tail_len))
        prompt = (base[:keep] + tail) or [draw(st.integers(0, VOCAB - 1))]
        max_tokens = draw(st.integers(8, 32) if pressure else st.one_of(st.none(), st.integers(1, 32)))
        params = dict(
            max_tokens=max_tokens,
            min_tokens=draw(st.integers(0, max_tokens or 4)),
            stop_token_ids=draw(st.lists(st.integers(0, VOCAB - 1), max_size=0 if pressure else 1)),
            ignore_eos=draw(st.booleans()),
        )
        eos = None if pressure else draw(st.sampled_from([None, None, 0]))
        arrival = draw(st.integers(0, 2 if pressure else 8))
        arrivals.append((arrival, make_request(i, prompt, eos=eos, **params)))
    aborts = draw(st.lists(st.tuples(st.integers(0, 30), st.integers(0, num_reqs - 1)), max_size=2))
    return dict(
        block_size=block_size, num_blocks=num_blocks, max_model_len=max_model_len, chunked=chunked,
        budget=budget, max_num_seqs=draw(st.integers(3 if pressure else 1, 6)), caching=pressure or draw(st.booleans()),
        arrivals=arrivals, aborts=[(s, f"r{i}") for s, i in aborts],
        num_spec=draw(st.sampled_from([0, 0, 1, 3])), p_wrong=draw(st.sampled_from([0.0, 0.3, 1.0])),
        window=draw(st.one_of(st.none(), st.integers(1, 12))), seed=draw(st.integers(0, 99)),
        separate=draw(st.sampled_from([0, 0, 4, 64])),
    )


def run_workload(w: dict) -> tuple[Scheduler, FakeRunner, dict[str, Request]]:
    kv = KVCacheManager(w["num_blocks"], w["block_size"], enable_prefix_caching=w["caching"])
    sched = Scheduler(kv, max_num_seqs=w["max_num_seqs"], max_num_batched_tokens=w["budget"],
                      max_model_len=w["max_model_len"], enable_chunked_prefill=w["chunked"],
                      sliding_window=w["window"], separate_prefill_tokens=w["separate"])
    runner = FakeRunner(kv, num_spec=w["num_spec"], p_wrong=w["p_wrong"], seed=w["seed"],
                        sliding_window=w["window"])
    reqs = run_to_completion(sched, runner, w["arrivals"], w["aborts"])
    assert_matches_reference(reqs, w["max_model_len"], aborted={rid for _, rid in w["aborts"]})
    if w["p_wrong"] == 0.0:
        assert all(r.num_accepted_tokens == r.num_draft_tokens for r in reqs.values())
    if w["p_wrong"] == 1.0:
        assert all(r.num_accepted_tokens == 0 for r in reqs.values())
    assert sched.stats().num_preemptions == sum(r.num_preemptions for r in reqs.values())
    return sched, runner, reqs


_PROPERTY = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_PROPERTY
@given(w=workloads())
def test_random_workloads_match_the_unscheduled_reference(w):
    """Tokens equal the scheduler-free reference whatever the blocks, budget, seats, chunking,
    preemptions, prefix hits, stops, aborts, drafts and window; KV invariants hold at every step."""
    run_workload(w)


@_PROPERTY
@given(w=workloads(pressure=True))
def test_memory_pressure_preempts_without_losing_tokens(w):
    """The same, under a pool that holds about one request: preemption by recompute and prefix
    re-hits of preempted requests' blocks dominate."""
    run_workload(w)


# ---- targeted scenarios -------------------------------------------------------------------------


def make_scheduler(num_blocks=64, block_size=4, *, max_num_seqs=8, budget=64, max_model_len=64, **kw):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=kw.pop("caching", True))
    return Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                     max_model_len=max_model_len, **kw)


def step(sched: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[Request]]:
    so = sched.schedule()
    return so, sched.update_from_output(so, runner.execute(so))


def test_chunked_prefill_splits_a_long_prompt():
    sched = make_scheduler(budget=8, max_model_len=32)
    runner = FakeRunner(sched.kv_cache)
    req = make_request(0, list(range(20)), max_tokens=3)
    sched.add_request(req)
    chunks = []
    while sched.has_unfinished_requests():
        so, _ = step(sched, runner)
        chunks.append(so.num_scheduled_tokens)
        if len(chunks) <= 2:
            assert req.num_output_tokens == 0 and req.num_computed_tokens == 8 * len(chunks)
    assert chunks == [8, 8, 4, 1, 1]
    assert runner.num_prefill_chunks_without_output == 2
    assert_matches_reference({req.request_id: req}, 32)


def test_chunk_shares_the_budget_with_decodes():
    sched = make_scheduler(budget=10, max_model_len=40)
    runner = FakeRunner(sched.kv_cache)
    a, b = make_request(0, [1, 2, 3], max_tokens=8), make_request(1, list(range(30)), max_tokens=2)
    sched.add_request(a)
    step(sched, runner)
    sched.add_request(b)
    so, _ = step(sched, runner)
    assert [(s.request.request_id, s.num_new_tokens) for s in so.scheduled] == [("r0", 1), ("r1", 9)]


def test_separate_prefills_admit_a_short_prompt_alone_and_a_long_one_alongside_the_decodes():
    sched = make_scheduler(budget=64, max_model_len=64, separate_prefill_tokens=8)
    runner = FakeRunner(sched.kv_cache)
    a, b, c = (make_request(i, list(range(s, s + n)), max_tokens=6) for i, s, n in ((0, 0, 3), (1, 3, 8), (2, 11, 9)))
    d, e = make_request(3, [5, 6], max_tokens=4), make_request(4, [7, 8], max_tokens=4)
    sched.add_request(a)
    sched.add_request(d)
    so, _ = step(sched, runner)  # nothing decodes yet: prompts are admitted together as before
    assert [s.request.request_id for s in so.scheduled] == ["r0", "r3"]
    sched.add_request(b)
    sched.add_request(e)
    so, _ = step(sched, runner)  # b (8 tokens) alone, the decodes wait
    assert [(s.request.request_id, s.num_new_tokens) for s in so.scheduled] == [("r1", 8)]
    so, _ = step(sched, runner)  # then e alone
    assert [(s.request.request_id, s.num_new_tokens) for s in so.scheduled] == [("r4", 2)]
    so, _ = step(sched, runner)  # then every decode together
    assert [(s.request.request_id, s.num_new_tokens) for s in so.scheduled] == [
        ("r0", 1), ("r3", 1), ("r1", 1), ("r4", 1)]
    sched.add_request(c)
    so, _ = step(sched, runner)  # 9 tokens: no prefill graph holds it, so it joins the decodes
    assert [s.request.request_id for s in so.scheduled] == ["r0", "r3", "r1", "r4", "r2"]
    reqs = {r.request_id: r for r in (a, b, c, d, e)}
    while sched.has_unfinished_requests():
        step(sched, runner)
    assert_matches_reference(reqs, 64)


def test_without_chunked_prefill_a_prompt_waits_until_it_fits_whole():
    sched = make_scheduler(budget=16, max_model_len=16, enable_chunked_prefill=False, max_num_seqs=4)
    runner = FakeRunner(sched.kv_cache)
    reqs = [make_request(i, [i] * 6, max_tokens=4) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    so, _ = step(sched, runner)
    assert [s.num_new_tokens for s in so.scheduled] == [6, 6]  # the third (6 > 4 left) waits
    so, _ = step(sched, runner)
    assert [s.num_new_tokens for s in so.scheduled] == [1, 1, 6]
    with pytest.raises(ValueError, match="chunked prefill"):
        make_scheduler(budget=8, max_model_len=16, enable_chunked_prefill=False)


def test_max_num_seqs_caps_running():
    sched = make_scheduler(max_num_seqs=2)
    runner = FakeRunner(sched.kv_cache)
    for i in range(4):
        sched.add_request(make_request(i, [i, i], max_tokens=3))
    so, _ = step(sched, runner)
    assert len(so.scheduled) == 2 and sched.num_running == 2 and sched.num_waiting == 2


def test_preemption_takes_the_newest_and_recomputes_its_outputs():
    # 6 usable blocks of 4: three requests of 5 prompt tokens take 2 blocks each; growing to 9 tokens
    # needs a third block, so the newest is preempted.
    sched = make_scheduler(num_blocks=7, block_size=4, max_model_len=24, caching=False)
    runner = FakeRunner(sched.kv_cache)
    reqs = {f"r{i}": make_request(i, [i + 1] * 5, max_tokens=10) for i in range(3)}
    for r in reqs.values():
        sched.add_request(r)
    preempted_order = []
    while sched.has_unfinished_requests():
        before = [r.request_id for r in sched.running]
        so = sched.schedule()
        check_step(sched, so, before)
        if so.preempted_req_ids:
            assert so.preempted_req_ids == {before[-1]}
            victim = reqs[before[-1]]
            assert victim.status == RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
            assert sched.waiting[0] is victim and victim.num_output_tokens > 0
            preempted_order.append(before[-1])
        sched.update_from_output(so, runner.execute(so))
    assert preempted_order and preempted_order[0] == "r2"
    assert sched.num_preemptions == len(preempted_order) == sched.stats().num_preemptions
    assert_matches_reference(reqs, 24)


def test_a_request_preempts_itself_when_it_is_the_newest():
    # 4 usable blocks of 2: a (1 token) takes 1, b (6 tokens) takes 3. Next step a still fits its
    # block, b needs a fourth: b is the newest, so it preempts itself and the step stops there.
    sched = make_scheduler(num_blocks=5, block_size=2, max_model_len=8, caching=False)
    runner = FakeRunner(sched.kv_cache)
    a, b = make_request(0, [1], max_tokens=5), make_request(1, [4, 5, 6, 7, 8, 9], max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)
    so = sched.schedule()
    assert so.preempted_req_ids == {"r1"} and [s.request.request_id for s in so.scheduled] == ["r0"]
    assert b.status == RequestStatus.PREEMPTED and b.num_output_tokens == 1 and sched.waiting[0] is b
    sched.update_from_output(so, runner.execute(so))
    assert not run_to_completion(sched, runner, [])
    assert_matches_reference({"r0": a, "r1": b}, 8)


def test_prefix_cache_hits_on_a_shared_prefix():
    sched = make_scheduler(block_size=4)
    runner = FakeRunner(sched.kv_cache)
    shared = list(range(1, 14))
    a = make_request(0, shared + [20, 21], max_tokens=4)
    b = make_request(1, shared + [22], max_tokens=4)
    c = make_request(2, shared + [20, 21], max_tokens=4, eos=None)
    reqs = run_to_completion(sched, runner, [(0, a), (3, b), (4, c)])
    assert b.num_cached_tokens == 12 and c.num_cached_tokens == 12  # never the last prompt token
    stats = sched.stats()
    assert stats.prefix_cache_hits == 24 and stats.prefix_cache_queries == 15 + 14 + 15
    assert stats.prefix_cache_hit_rate == pytest.approx(24 / 44)
    assert_matches_reference(reqs, 64)


def test_concurrent_requests_share_cached_blocks():
    sched = make_scheduler(block_size=2)
    runner = FakeRunner(sched.kv_cache)
    a = make_request(0, [5, 6, 7, 8, 9], max_tokens=6)
    b = make_request(1, [5, 6, 7, 8, 1], max_tokens=6)
    sched.add_request(a)
    step(sched, runner)
    sched.add_request(b)
    step(sched, runner)
    ta, tb = sched.kv_cache.get_block_ids("r0"), sched.kv_cache.get_block_ids("r1")
    assert ta[:2] == tb[:2] and ta[2] != tb[2]
    assert all(sched.kv_cache.pool.blocks[x].ref_cnt == 2 for x in ta[:2])
    assert_kv_invariants(sched.kv_cache, {"r0": a, "r1": b})
    assert_matches_reference(run_to_completion(sched, runner, []) | {"r0": a, "r1": b}, 64)


def test_preempted_request_reuses_its_cached_prefix():
    sched = make_scheduler(num_blocks=9, block_size=2, max_model_len=16)
    runner = FakeRunner(sched.kv_cache)
    # b is preempted at a's first block boundary; a finishes before evicting b's cached head.
    a, b = make_request(0, [1] * 7, max_tokens=4), make_request(1, [2] * 7, max_tokens=9)
    reqs = run_to_completion(sched, runner, [(0, a), (0, b)])
    assert sched.num_preemptions > 0 and sched.stats().prefix_cache_hits > 0
    assert_matches_reference(reqs, 16)


def scripted_step(sched: Scheduler, tokens: dict[str, list[int]], drafts=None):
    so = sched.schedule()
    ids = [s.request.request_id for s in so.scheduled]
    ro = RunnerOutput(ids, [tokens.get(i, []) for i in ids], num_proposed=drafts or {})
    return so, sched.update_from_output(so, ro)


@pytest.mark.parametrize(
    "params, eos, script, expected, reason, stop_reason",
    [
        (dict(max_tokens=10), 9, [3, 9, 4], [3, 9], "stop", None),
        (dict(max_tokens=10, min_tokens=3), 9, [9, 9, 9, 4], [9, 9, 9], "stop", None),
        (dict(max_tokens=3, ignore_eos=True), 9, [9, 9, 4], [9, 9, 4], "length", None),
        (dict(max_tokens=10, stop_token_ids=[4, 5]), 9, [3, 5, 1], [3, 5], "stop", 5),
        (dict(max_tokens=10, stop_token_ids=[4], min_tokens=2), None, [4, 4], [4, 4], "stop", 4),
        (dict(max_tokens=2), 9, [1, 2, 9], [1, 2], "length", None),
        (dict(max_tokens=None), None, [1] * 10, [1] * 6, "length", None),  # max_model_len 8, prompt 2
    ],
)
def test_stop_conditions(params, eos, script, expected, reason, stop_reason):
    sched = make_scheduler(max_model_len=8)
    req = make_request(0, [7, 7], eos=eos, **params)
    sched.add_request(req)
    finished = []
    for t in script:
        _, finished = scripted_step(sched, {"r0": [t]})
        if finished:
            break
    assert finished == [req] and req.output_token_ids == expected
    assert (req.finish_reason, req.stop_reason) == (reason, stop_reason)
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks - 1


def test_tokens_after_a_stop_in_accepted_drafts_are_dropped():
    sched = make_scheduler(block_size=2)
    req = make_request(0, [1, 2, 3], eos=9, max_tokens=10)
    sched.add_request(req)
    scripted_step(sched, {"r0": [4]}, {"r0": 3})
    so, finished = scripted_step(sched, {"r0": [5, 9, 6, 8]})
    assert so.scheduled[0].num_spec_tokens == 3 and so.scheduled[0].num_new_tokens == 4
    assert finished == [req] and req.output_token_ids == [4, 5, 9] and req.finish_reason == "stop"
    assert req.num_draft_tokens == 3 and req.num_accepted_tokens == 3
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks - 1


def test_rejected_drafts_roll_back_num_computed_tokens():
    sched = make_scheduler(block_size=2)
    req = make_request(0, [1, 2, 3], max_tokens=20)
    sched.add_request(req)
    scripted_step(sched, {"r0": [4]}, {"r0": 3})
    assert req.num_computed_tokens == 3 and req.num_spec_tokens == 3
    so, _ = scripted_step(sched, {"r0": [5, 8]}, {"r0": 2})  # accept 5, reject 6, bonus 8
    assert so.scheduled[0].num_new_tokens == 4
    assert req.output_token_ids == [4, 5, 8] and req.num_computed_tokens == 5 == req.num_tokens - 1
    assert (req.num_draft_tokens, req.num_accepted_tokens) == (3, 1)
    so, _ = scripted_step(sched, {"r0": [2]})  # all rejected
    assert so.scheduled[0].num_new_tokens == 3 and req.num_computed_tokens == 6
    assert (req.num_draft_tokens, req.num_accepted_tokens) == (5, 1)


def test_verify_steps_scheduled_ahead_assume_every_draft_and_resolve_the_rejected_ones():
    """Async scheduling of verify steps: `assume_launched` counts all k drafts as accepted (k + 1 outputs in flight,
    k drafts for the next step), the next verify step is scheduled from that guess, and each collected step appends
    its tokens in place of its own outputs in flight and takes back the computed count of its rejected drafts; a
    stop inside a step drops the step in flight behind it."""
    sched = make_scheduler(block_size=2, max_model_len=40)
    req = make_request(0, [1, 2, 3], eos=9, max_tokens=30)
    sched.add_request(req)
    scripted_step(sched, {"r0": [4]}, {"r0": 3})  # prefill; three drafts
    n = sched.schedule()  # step N verifies the three drafts
    assert n.scheduled[0].num_new_tokens == 4
    sched.assume_launched(n)
    assert req.output_token_ids == [4] and req.num_output_placeholders == 4 and req.num_spec_tokens == 3
    assert req.num_computed_tokens == 7 == req.num_tokens - 1
    assert sched.can_schedule_ahead(n)
    ahead = sched.schedule()  # step N + 1, before N is known: the newest token and 3 drafts, all on the device
    assert ahead.scheduled[0].num_new_tokens == 4 and ahead.scheduled[0].num_spec_tokens == 3
    sched.assume_launched(ahead)
    assert req.num_output_placeholders == 8 and req.num_computed_tokens == 11
    # N accepted 5, rejected 6: it emits [5, 8]; its two other placeholders and their computed slots go
    sched.update_from_output(n, RunnerOutput(["r0"], [[5, 8]]))
    assert req.output_token_ids == [4, 5, 8] and req.num_output_placeholders == 4 and req.num_computed_tokens == 9
    assert (req.num_draft_tokens, req.num_accepted_tokens) == (3, 1)
    assert req.num_spec_tokens == 3, "N + 1's drafts, still in flight, are not N's to replace"
    # N + 1 accepted all three and its bonus: no correction; nothing in flight now, so its proposal is taken
    sched.update_from_output(ahead, RunnerOutput(["r0"], [[1, 2, 3, 4]], num_proposed={"r0": 1}))
    assert req.output_token_ids == [4, 5, 8, 1, 2, 3, 4] and req.num_computed_tokens == 9 == req.num_tokens - 1
    assert req.num_spec_tokens == 1 and (req.num_draft_tokens, req.num_accepted_tokens) == (6, 4)
    # A stop (eos) inside a step drops the step in flight behind it
    n = sched.schedule()
    sched.assume_launched(n)
    ahead = sched.schedule()
    sched.assume_launched(ahead)
    finished = sched.update_from_output(n, RunnerOutput(["r0"], [[9, 1]]))
    assert finished == [req] and req.output_token_ids == [4, 5, 8, 1, 2, 3, 4, 9] and req.finish_reason == "stop"
    assert not req.num_output_placeholders and not req.num_spec_tokens
    assert sched.update_from_output(ahead, RunnerOutput(["r0"], [[7]])) == [] and req.output_token_ids[-1] == 9
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks - 1


def _verify_step_in_flight(max_model_len: int, max_num_seqs: int = 8) -> tuple[Scheduler, SchedulerOutput]:
    """A request of 8 tokens (3 drafts) whose verify step is launched and assumed."""
    sched = make_scheduler(block_size=2, max_model_len=max_model_len, max_num_seqs=max_num_seqs)
    sched.add_request(make_request(0, [1, 2, 3], max_tokens=30))
    scripted_step(sched, {"r0": [4]}, {"r0": 3})
    n = sched.schedule()
    sched.assume_launched(n)
    return sched, n


@pytest.mark.parametrize("max_num_seqs", [1, 2])
def test_no_verify_step_is_scheduled_ahead_near_max_model_len_or_when_a_request_could_join(max_num_seqs):
    sched, n = _verify_step_in_flight(max_model_len=14)  # the next step's drafts and tokens could pass 14
    assert not sched.can_schedule_ahead(n)
    sched, n = _verify_step_in_flight(max_model_len=40, max_num_seqs=max_num_seqs)
    assert sched.can_schedule_ahead(n)
    sched.add_request(make_request(1, [1, 2], max_tokens=5))  # waiting: it joins the next step if a seat is free
    assert sched.can_schedule_ahead(n) == (max_num_seqs == 1)


def test_drafts_are_trimmed_by_budget_and_max_model_len_not_max_tokens():
    sched = make_scheduler(block_size=2, budget=3, max_model_len=12)
    req = make_request(0, [1, 2, 3], max_tokens=20)
    sched.add_request(req)
    scripted_step(sched, {"r0": [4]}, {"r0": 4})
    so, _ = scripted_step(sched, {"r0": [5, 6, 9]}, {"r0": 8})  # budget 3: 1 + 2 drafts
    assert so.scheduled[0].num_spec_tokens == 2 and so.scheduled[0].num_new_tokens == 3
    # 7 tokens, max_model_len 12: at most 5 more tokens, so at most 4 drafts -> budget keeps 2.
    assert req.num_tokens == 7
    sched.max_num_batched_tokens = 10
    so, _ = scripted_step(sched, {"r0": [1, 1, 1, 1, 1]})
    assert so.scheduled[0].num_spec_tokens == 4 and req.finish_reason == "length"
    assert req.num_tokens == 12
    req2 = make_request(1, [1, 2, 3], max_tokens=3)
    sched.add_request(req2)
    scripted_step(sched, {"r1": [4]}, {"r1": 8})
    so, _ = scripted_step(sched, {"r1": [1, 1, 1, 1]})
    # 2 outputs left, but drafts stop only at max_model_len (4 tokens of 12: 7 drafts), within the budget of 10;
    # the stop check keeps 2 of the 4 emitted tokens
    assert so.scheduled[0].num_spec_tokens == 7
    assert req2.output_token_ids == [4, 1, 1] and req2.finish_reason == "length"


def test_abort_waiting_and_running_requests():
    sched = make_scheduler(max_num_seqs=1)
    runner = FakeRunner(sched.kv_cache)
    a, b = make_request(0, [1, 2, 3], max_tokens=8), make_request(1, [4, 5], max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)
    assert sched.abort_request("r1") is b and b.finish_reason == "abort" and b.is_finished
    assert sched.abort_request("r0", "error") is a and a.finish_reason == "error"
    assert sched.abort_request("r0") is None and sched.abort_request("nope") is None
    assert not sched.has_unfinished_requests()
    so = sched.schedule()
    assert so.finished_req_ids == {"r0", "r1"} and not so.scheduled
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks - 1


def test_add_request_validates_at_the_edge():
    sched = make_scheduler(max_model_len=8)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_request(0, list(range(9))))
    with pytest.raises(ValueError):
        sched.add_request(make_request(0, []))
    sched.add_request(make_request(0, [1]))
    with pytest.raises(ValueError, match="already"):
        sched.add_request(make_request(0, [1]))
    with pytest.raises(ValueError, match="KV cache holds"):
        make_scheduler(num_blocks=3, block_size=4, max_model_len=9)


def test_prompt_of_max_model_len_emits_one_token():
    sched = make_scheduler(block_size=4, max_model_len=8)
    runner = FakeRunner(sched.kv_cache)
    req = make_request(0, list(range(8)), max_tokens=5)
    reqs = run_to_completion(sched, runner, [(0, req)])
    assert req.output_token_ids and req.num_output_tokens == 1 and req.finish_reason == "length"
    assert_matches_reference(reqs, 8)


def test_sliding_window_frees_blocks_during_decode():
    sched = make_scheduler(num_blocks=40, block_size=2, max_model_len=40, sliding_window=4)
    runner = FakeRunner(sched.kv_cache, sliding_window=4)
    req = make_request(0, list(range(10)), max_tokens=20, ignore_eos=True)
    sched.add_request(req)
    max_live = 0
    while sched.has_unfinished_requests():
        step(sched, runner)
        live = [b for b in sched.kv_cache.get_block_ids("r0") if b != NULL_BLOCK_ID]
        max_live = max(max_live, len(live))
    assert max_live <= 6  # 10 prompt tokens, then a window of 4 plus the block being filled
    assert_matches_reference({"r0": req}, 40)
    assert sched.kv_cache.num_free_blocks == 39


def test_first_token_time_is_set_once():
    sched = make_scheduler(budget=4)
    runner = FakeRunner(sched.kv_cache)
    req = make_request(0, list(range(6)), max_tokens=3)
    sched.add_request(req)
    step(sched, runner)
    assert req.first_token_time is None
    step(sched, runner)
    t0 = req.first_token_time
    assert t0 is not None
    step(sched, runner)
    assert req.first_token_time == t0
