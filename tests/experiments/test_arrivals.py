"""Poisson arrivals (workload.request_rate) and the serving loop that feeds them, on a simulated clock."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from research_lm.harness.experiment import serve
from research_lm.harness.workloads import WorkloadSpec, arrival_times, build_workload


def test_poisson_arrivals_increase_at_the_requested_mean_rate():
    times = arrival_times(4000, request_rate=8.0, seed=3)
    assert times[0] == 0.0
    gaps = np.diff(times)
    assert (gaps > 0).all()
    assert 1 / gaps.mean() == pytest.approx(8.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)  # exponential gaps: CV = 1
    assert arrival_times(4000, 8.0, seed=3) == times  # seeded
    bursty = np.diff(arrival_times(4000, 8.0, burstiness=0.25, seed=3))
    assert 1 / bursty.mean() == pytest.approx(8.0, rel=0.1) and bursty.std() / bursty.mean() > 1.5


@pytest.mark.parametrize("rate", [0.0, -1.0, math.nan])
def test_bad_rates_are_refused(rate):
    with pytest.raises(ValueError, match="request_rate"):
        arrival_times(3, rate)


def test_arrivals_do_not_change_the_prompts():
    plain = build_workload(WorkloadSpec(kind="synthetic", num_requests=5, input_len=(4, 8), output_len=(2, 3)), 100)
    timed = build_workload(WorkloadSpec(kind="synthetic", num_requests=5, input_len=(4, 8), output_len=(2, 3),
                                        request_rate=2.0), 100)
    assert plain.arrival_times is None and timed.prompts == plain.prompts
    assert len(timed.arrival_times) == 5 and timed.fingerprint() != plain.fingerprint()
    assert build_workload(WorkloadSpec(kind="synthetic", num_requests=2, request_rate=math.inf), 100).arrival_times \
        is None


class SimClock:
    def __init__(self):
        self.t = 100.0
        self.slept = 0.0

    def now(self) -> float:
        return self.t

    def sleep(self, dt: float) -> None:
        assert dt >= 0
        self.t += dt
        self.slept += dt


class FakeEngine:
    """Each step takes `step_s` simulated seconds and finishes every request that was added before it."""

    def __init__(self, clock: SimClock, step_s: float):
        self.clock, self.step_s = clock, step_s
        self.queue, self.added = [], []

    def add_request(self, prompt, params):
        req = SimpleNamespace(request_id=str(len(self.added)), arrival_time=None, added_at=self.clock.t)
        self.added.append(req)
        self.queue.append(req)
        return req

    def has_unfinished_requests(self) -> bool:
        return bool(self.queue)

    def step(self):
        self.clock.t += self.step_s
        done, self.queue = self.queue, []
        return [SimpleNamespace(request_id=r.request_id) for r in done]


def test_serve_adds_requests_as_they_arrive_on_a_simulated_clock():
    clock = SimClock()
    engine = FakeEngine(clock, step_s=0.05)
    arrivals = arrival_times(200, request_rate=4.0, seed=1)
    outs = serve(engine, list(range(200)), [None] * 200, arrivals, clock=clock.now, sleep=clock.sleep,
                 progress=False)
    assert [o.request_id for o in outs] == [str(i) for i in range(200)]  # in prompt order
    t0 = 100.0
    for req, a in zip(engine.added, arrivals):
        assert req.added_at >= t0 + a - 1e-6  # never before it arrives
        assert req.added_at <= t0 + a + engine.step_s + 1e-9  # at most one step late
        assert req.arrival_time == pytest.approx(t0 + a)  # latency counts from the arrival
    # 4 req/s with 50 ms steps: the engine idles most of the time, waiting on the next arrival
    assert clock.slept > 0.5 * arrivals[-1]
    assert clock.t - t0 == pytest.approx(arrivals[-1] + engine.step_s, abs=engine.step_s + 1e-9)


def test_serve_without_arrivals_adds_everything_before_the_first_step():
    clock = SimClock()
    engine = FakeEngine(clock, step_s=1.0)
    serve(engine, ["a", "b", "c"], [None] * 3, None, clock=clock.now, sleep=clock.sleep, progress=False)
    assert [r.added_at for r in engine.added] == [100.0] * 3 and clock.slept == 0.0
