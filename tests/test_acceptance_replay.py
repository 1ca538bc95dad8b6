"""Acceptance replay (research_lm/worker/acceptance_replay.py): verify steps run for real and each request keeps the
number of drafts its profile replays. These tests check the replayed counts, never the tokens: the replayed tau and
per-position rates reproduce the profile within bounds derived from their variance, a trace replays in order, a
request's counts do not depend on its batch, the graph + async path counts as the eager one, what is refused, the
marking of outputs and results.json, and that a real run's recorded profile replays to the run's own tau."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir

from research_lm import LLM, SamplingParams
from research_lm.api.config import EngineConfig
from research_lm.harness.experiment import AcceptanceMetrics, run
from research_lm.worker.acceptance_replay import (
    AcceptanceReplay,
    expected_tau,
    load_profile,
    profile_from_rates,
    profile_from_steps,
    profile_from_tau,
    write_profile,
)
from research_lm.worker.cuda_graphs import eager_capture

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
K = 3
EAGLE3 = {"method": "eagle3", "model": "tiny-llama-eagle3", "num_speculative_tokens": K}
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
RATES = (0.8, 0.6, 0.5)
PROFILE = {"source": "test rates", "num_speculative_tokens": K, "per_position": list(RATES), "trace": None}
KNOBS = dict(device="cpu", dtype="float32", max_model_len=512, max_num_seqs=4)
PROMPTS = ["def add(a, b):\n    return a + b\n", "import os\nimport sys\n", "class A:\n    pass\n", "x = [1, 2, 3]\n"]
Z = 4.0  # bounds at 4 standard deviations: a correct replay fails one of them with probability ~1e-4


def _run(spec: dict, replay, prompts=PROMPTS, max_tokens: int | list[int] = 160, temperature: float = 0.0, **knobs):
    """Serve prompts (max_tokens: one, or one per prompt); (outputs, per-request verify steps [drafts, accepted])."""
    llm = LLM("tiny-llama", **(KNOBS | knobs), speculative_config=spec, acceptance_replay=replay)
    llm.engine.metrics = AcceptanceMetrics(traces={})
    lengths = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, seed=3) for n in lengths]
    return llm.generate(prompts, params, use_tqdm=False), llm.engine.metrics.traces


def _survival(rates, d: int) -> list[float]:
    """S_j = P(n >= j), j = 1 .. d: the product of the first j conditional rates."""
    out, s = [], 1.0
    for a in rates[:d]:
        s *= a
        out.append(s)
    return out


def test_profile_constructors_and_expected_tau(tmp_path):
    profile = load_profile(PROFILE)
    assert expected_tau(profile) == pytest.approx(1 + 0.8 + 0.48 + 0.24)
    assert expected_tau(profile, k=1) == pytest.approx(1.8)
    assert load_profile(write_profile(profile, tmp_path / "p.json")) == profile
    geometric = profile_from_tau(3.08, 4, "vLLM #20780 EAGLE-3 Llama-3.1-8B MT-bench K=4")
    assert expected_tau(geometric) == pytest.approx(3.08, abs=1e-9) and len(set(geometric.per_position)) == 1
    # conditional rates: position 2 judged only where position 1 was accepted
    steps = [[3, 0], [3, 1], [3, 3], [2, 2], [3, 1]]
    assert profile_from_steps(steps, 3, "s").per_position == pytest.approx((4 / 5, 2 / 4, 1 / 1))
    assert profile_from_rates([0.5, 0.5], "r", traces=[[[2, 1]]]).traces == (((2, 1),),)
    one = {**PROFILE, "trace": [[3, 1]]}  # one trace for every request: read as traces of one
    assert load_profile(one).traces == (((3, 1),),) and load_profile(one) == load_profile(
        {**PROFILE, "traces": [[[3, 1]]]})


@pytest.mark.parametrize("bad, match", [
    ({**PROFILE, "per_position": [0.8, 1.2, 0.5]}, "3 rates in"),
    ({**PROFILE, "per_position": [0.8]}, "3 rates in"),
    ({**PROFILE, "source": ""}, "source"),
    ({**PROFILE, "trace": [[3, 4]]}, "trace"),
    ({**PROFILE, "traces": [[[3, 1]], [[3, 4]]]}, "trace"),
    ({**PROFILE, "traces": []}, "traces"),
    ({**PROFILE, "trace": [[3, 1]], "traces": [[[3, 1]]]}, "not both"),
    ({**PROFILE, "extra": 1}, "unknown"),
    ("/nonexistent/profile.json", "no profile file"),
])
def test_bad_profiles_are_refused_naming_the_field(bad, match):
    with pytest.raises(ValueError, match=match):
        load_profile(bad)


@pytest.mark.parametrize("spec", [EAGLE3, NGRAM], ids=["eagle3", "ngram"])
def test_replayed_tau_and_rates_reproduce_the_profile(spec):
    """Per verify step with d real drafts, E[n] = sum_j S_j and Var[n] = sum_j (2j - 1) S_j - E[n]^2: the replayed
    accepted total lies within Z standard deviations of its expectation; each position's rate (accepted / judged)
    within Z binomial deviations of a_j. Two rows for four requests of different lengths: later prompts are
    prefilled in the steps that verify the others' drafts."""
    _, traces = _run(spec, PROFILE, max_tokens=[240, 80, 200, 160], max_num_seqs=2)
    steps = [s for t in traces.values() for s in t]
    assert len(steps) >= 150, "enough verify steps to measure"
    mean = var = 0.0
    for d, _ in steps:
        s = _survival(RATES, d)
        e = sum(s)
        mean, var = mean + e, var + sum((2 * j + 1) * x for j, x in enumerate(s)) - e * e
    assert abs(sum(a for _, a in steps) - mean) <= Z * math.sqrt(var)
    judged = [sum(1 for d, a in steps if d > j and a >= j) for j in range(K)]
    measured = profile_from_steps(steps, K, "replayed").per_position
    for a, p, n in zip(RATES, measured, judged, strict=True):
        assert n > 20 and abs(p - a) <= Z * math.sqrt(a * (1 - a) / n)


def test_a_trace_replays_in_order_per_request():
    """Each request reads the trace from its start, one entry per verify step, around again at its end; a count is
    capped by the step's real drafts (fewer at the end of a request)."""
    trace = [[3, 2], [3, 0], [3, 3], [3, 1], [2, 1]]
    _, traces = _run(EAGLE3, {**PROFILE, "trace": trace}, prompts=PROMPTS[:2], max_tokens=40)
    for steps in traces.values():
        assert len(steps) > len(trace)
        assert [a for _, a in steps] == [min(trace[c % len(trace)][1], d) for c, (d, _) in enumerate(steps)]


def test_each_request_replays_its_own_trace_in_prompt_order():
    """With per-request traces, the i-th request to verify (prompt order: one row, requests in turn) replays trace
    i mod len(traces): here request 2 replays trace 0 again."""
    own = [[[3, 3], [3, 0]], [[3, 1]]]
    _, traces = _run(EAGLE3, {**PROFILE, "traces": own}, prompts=PROMPTS[:3], max_tokens=30, max_num_seqs=1)
    assert len(traces) == 3
    for i, steps in enumerate(traces.values()):  # (AcceptanceMetrics keeps the requests in the order they verified)
        trace = own[i % len(own)]
        assert [a for _, a in steps] == [min(trace[c % len(trace)][1], d) for c, (d, _) in enumerate(steps)]


def test_rewind_gives_the_measured_runs_first_request_the_first_trace():
    """Warm-up requests replay traces too (the harness serves them through the same engine); `rewind` before the
    measured run makes its i-th request replay trace i again, as in the run that recorded them."""
    profile = load_profile({**PROFILE, "trace": None, "traces": [[[3, 1]], [[3, 2]], [[3, 3]]]})
    replay = AcceptanceReplay(profile, K, torch.device("cpu"), max_num_reqs=4)
    request = [SimpleNamespace(request_id=str(i), seed=i) for i in range(3)]
    replay.admit((), request[:1], {"0": 0})  # a warm-up request: trace 0
    replay.rewind()
    replay.admit({"0"}, request[1:], {"1": 1, "2": 2})
    assert replay.trace_of[1:3].tolist() == [0, 1]


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_a_requests_replayed_counts_do_not_depend_on_its_batch(temperature):
    """The uniforms are keyed by (seed, token count): request 0 alone and beside three others (two rows: the later
    prompts are prefilled in steps that verify request 0's drafts) keeps the same counts, greedy or sampled (the
    rejection sampler's path)."""
    _, alone = _run(EAGLE3, PROFILE, prompts=PROMPTS[:1], max_tokens=80, temperature=temperature)
    _, batched = _run(EAGLE3, PROFILE, prompts=PROMPTS, max_tokens=[80, 20, 30, 40], temperature=temperature,
                      max_num_seqs=2)
    assert alone["0"] == batched["0"] and len(alone["0"]) > 10


@pytest.mark.parametrize("profile", [{**PROFILE, "traces": [[[3, 3], [3, 1], [3, 0]], [[3, 2]]]}],
                         ids=["traces"])  # (rates replay through the same steps: test_replayed_tau_and_rates_...; 42 s)
def test_verify_graphs_with_drafting_behind_them_replay_as_eager_steps(profile, monkeypatch):
    """Verify graphs (re-run on CPU, the triton backend interpreted), EAGLE-3's "verified" draft graphs and async
    scheduling: the graphs compute the replayed counts themselves (`accept_greedily`), and the counts and tokens equal
    the synchronous eager engine's. The draft graph re-derives acceptance from the verify's argmax, which the replay
    rewrites; were it not, the drafter would enter other tokens and the tokens would differ."""
    in_graph = []
    accept = AcceptanceReplay.accept_greedily
    monkeypatch.setattr(AcceptanceReplay, "accept_greedily", lambda *a: in_graph.append(1) or accept(*a))
    knobs = dict(block_size=4, max_num_batched_tokens=16, num_gpu_blocks=60, max_model_len=64,
                 attention_backend="triton", enable_prefix_caching=False)
    prompts, params = PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, seed=3)
    eager, eager_steps = _run(EAGLE3, profile, prompts=prompts, max_tokens=16, **knobs)
    llm = LLM("tiny-llama", **(KNOBS | knobs), speculative_config=EAGLE3, acceptance_replay=profile,
              async_scheduling=True)
    assert llm.engine.runner.capture_cuda_graphs([1, 2, 4], prefill_sizes=[], capture=eager_capture) is None
    proposer, early = llm.engine.runner.proposer, []
    propose_on_device = proposer.propose_on_device
    proposer.propose_on_device = lambda outcome: early.append(d := propose_on_device(outcome)) or d
    llm.engine.metrics = AcceptanceMetrics(traces={})
    graphs = llm.generate(prompts, params, use_tqdm=False)
    assert sum(d is not None and d.in_table for d in early) >= 3, "drafted behind the verify graph"
    assert len(in_graph) >= 3, "the verify graphs computed the replay"
    assert llm.engine.metrics.traces == eager_steps
    assert [o.outputs[0].token_ids for o in graphs] == [o.outputs[0].token_ids for o in eager]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs+async"])
def test_echo_keeps_ngram_drafting_on_a_periodic_prompt(graphs, monkeypatch):
    """A random block of P ids repeated: with acceptance_replay_echo=P the text keeps repeating the block, so ngram
    drafts k tokens in every verify step whatever the replay kept; without echo the target's own tokens break the
    repeats. Through verify graphs with async launch too (the kernel's path reads the token table)."""
    P, n_out = 8, 16 if graphs else 48  # (the interpreted kernels are slow)
    block = torch.randint(10, 1000, (P,), generator=torch.Generator().manual_seed(0)).tolist()
    prompts = [block * 4, block[3:] + block * 3]
    in_graph = []
    accept = AcceptanceReplay.accept_greedily
    monkeypatch.setattr(AcceptanceReplay, "accept_greedily", lambda *a: in_graph.append(1) or accept(*a))
    knobs = dict(block_size=4, max_num_batched_tokens=64, num_gpu_blocks=80, max_model_len=128,
                 attention_backend="triton", enable_prefix_caching=False, async_scheduling=True) if graphs else {}
    spec = {**NGRAM, "prompt_lookup_min": 2, "prompt_lookup_max": 5}

    def serve(echo: int):
        llm = LLM("tiny-llama", **(KNOBS | knobs), speculative_config=spec, acceptance_replay=PROFILE,
                  acceptance_replay_echo=echo)
        if graphs:
            assert llm.engine.runner.capture_cuda_graphs([1, 2], prefill_sizes=[], capture=eager_capture) is None
        llm.engine.metrics = AcceptanceMetrics(traces={})
        params = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True, seed=3)
        return llm.generate(prompts, params, use_tqdm=False), llm.engine.metrics.traces

    outputs, traces = serve(P)
    for prompt, out in zip(prompts, outputs, strict=True):  # (the prompt step's token is the target's own: the
        text = prompt + out.outputs[0].token_ids  # drafts kept after it may continue either repeat)
        assert len(text) == len(prompt) + n_out and sum(text[t] == text[t - P] for t in range(P, len(text))) >= 0.8 * (
            len(text) - P)
    steps = [s for t in traces.values() for s in t]
    assert len(steps) >= n_out / 3 and all(d == K for d, _ in steps[:-2])  # (the last ones: max_tokens)
    assert sum(a for _, a in steps) < len(steps) * K  # the profile, not the repeats, decided what was kept
    if graphs:
        assert len(in_graph) >= 8
    else:
        _, plain = serve(0)
        assert sum(len(t) for t in plain.values()) < len(steps) / 2


def test_replay_is_refused_without_speculation_with_a_tree_and_with_too_few_positions():
    with pytest.raises(ValueError, match="needs a speculative_config"):
        EngineConfig(acceptance_replay=PROFILE)
    tree = {"method": "eagle3", "model": "tiny-llama-eagle3", "num_speculative_tokens": None,
            "speculative_token_tree": "[(0,), (1,), (0, 0)]"}
    with pytest.raises(ValueError, match="chains only"):
        LLM("tiny-llama", **KNOBS, speculative_config=tree, acceptance_replay=PROFILE)
    with pytest.raises(ValueError, match="acceptance_replay_echo shapes replayed tokens: it needs"):
        EngineConfig(acceptance_replay_echo=8)
    with pytest.raises(ValueError, match="acceptance_replay_echo must exceed num_speculative_tokens"):
        LLM("tiny-llama", **KNOBS, speculative_config=EAGLE3, acceptance_replay=PROFILE, acceptance_replay_echo=K)
    with pytest.raises(ValueError, match="rates for 3 draft positions; the run drafts 4"):
        LLM("tiny-llama", **KNOBS, speculative_config={**EAGLE3, "num_speculative_tokens": 4},
            acceptance_replay=PROFILE)


def test_every_output_of_a_replaying_engine_is_marked():
    outputs, _ = _run(EAGLE3, PROFILE, prompts=PROMPTS[:2], max_tokens=8)
    assert [o.acceptance_replayed for o in outputs] == ["test rates"] * 2
    plain = LLM("tiny-llama", **KNOBS, speculative_config=EAGLE3)
    assert plain.generate(PROMPTS[:1], SamplingParams(max_tokens=4), use_tqdm=False)[0].acceptance_replayed is None


def _harness(tmp_path, name: str, *overrides: str) -> dict:
    """The quickstart preset (EAGLE-3, baseline spec=none) in-process, tiny; its results.json."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=quickstart", "logger=none", "device=cpu",
                                           "workload.num_requests=2", "workload.max_tokens=48", *overrides])
    run(cfg, tmp_path / name)
    return json.loads((tmp_path / name / "results.json").read_text())


def test_harness_marks_a_replayed_run_and_drops_the_output_comparison(tmp_path):
    profile = write_profile(load_profile(PROFILE), tmp_path / "profile.json")
    results = _harness(tmp_path, "replayed", f"acceptance_replay={profile}")
    summary = results["summary"]
    assert summary["acceptance"] == "replayed(test rates)"
    assert summary["outputs_match_baseline"] is None and "speedup" in summary
    assert summary["acceptance_replay_expected_tau"] == pytest.approx(expected_tau(load_profile(PROFILE)))
    assert any("not the model's" in n for n in results["notes"])
    assert "acceptance" not in results["baseline"]["summary"]  # spec: none replays nothing


def test_a_recorded_profile_replays_to_the_runs_own_tau(tmp_path):
    """record_acceptance=true writes the run's profile. Replayed on the same run (two requests one after the other):
    by their traces, the very same counts (the same tau and steps); by its rates alone, the recorded tau within Z
    standard deviations of both runs' means."""
    one = ("baseline=null", "workload.num_requests=2", "runner.max_num_seqs=1", "workload.max_tokens=200")
    real = _harness(tmp_path, "real", "record_acceptance=true", *one)
    path = tmp_path / "real" / "acceptance_profile.json"
    profile = load_profile(str(path))
    assert real["acceptance_profile"] == str(path) and str(tmp_path / "real") in profile.source
    assert "acceptance" not in real["summary"]
    tau = real["summary"]["mean_acceptance_length"]
    steps = [step for trace in profile.traces for step in trace]
    assert len(profile.traces) == 2 and 1 + sum(a for _, a in steps) / len(steps) == pytest.approx(tau)
    traced = _harness(tmp_path, "traced", f"acceptance_replay={path}", *one)["summary"]
    assert traced["mean_acceptance_length"] == pytest.approx(tau)
    assert traced["num_verify_steps"] == real["summary"]["num_verify_steps"] == len(steps)
    rates_only = write_profile(profile_from_rates(profile.per_position, profile.source), tmp_path / "rates.json")
    replayed = _harness(tmp_path, "rates", f"acceptance_replay={rates_only}", *one)["summary"]
    s = _survival(profile.per_position, K)
    sd = math.sqrt(sum((2 * j + 1) * x for j, x in enumerate(s)) - sum(s) ** 2)  # of one step's n
    assert abs(replayed["mean_acceptance_length"] - tau) <= Z * sd * math.sqrt(
        1 / len(steps) + 1 / replayed["num_verify_steps"])


def test_harness_refuses_recording_a_replay(tmp_path):
    with pytest.raises(ValueError, match="drop one"):
        _harness(tmp_path, "both", "record_acceptance=true", f"acceptance_replay={tmp_path}/p.json")


def test_a_shipped_profile_loads_by_name_and_an_unknown_one_lists_them():
    from research_lm.worker.acceptance_replay import expected_tau, load_profile

    anchor = load_profile("vllm_eagle3_llama31_8b_mtbench_k4")
    assert anchor.num_speculative_tokens == 4 and abs(expected_tau(anchor) - 3.08) < 1e-3
    with pytest.raises(ValueError, match=r"no shipped profile of that name \(shipped: \['reference_draft_model_k5', "
                                         r"'reference_eagle3_k5', 'reference_medusa_k5', 'reference_ngram_k5', "
                                         r"'vllm_eagle3_llama31_8b"):
        load_profile("no_such_profile")
    for method in ("eagle3", "medusa", "draft_model", "ngram"):  # the reference pair's, recorded on the GPU
        profile = load_profile(f"reference_{method}_k5")
        assert profile.num_speculative_tokens == 5 and len(profile.traces) == 8 and f"{method} k=5" in profile.source
    assert abs(expected_tau(load_profile("reference_eagle3_k5")) - 4.133) < 1e-3  # spec_replay_validation_h200's tau


@pytest.mark.gpu
def test_on_cuda_eagle3_replays_from_graphs_and_launches_ahead():
    """On CUDA (real verify and draft graphs, async scheduling, bfloat16): EAGLE-3 drafts behind the verify graph
    under replay, and the replayed counts equal a synchronous float32 engine's, as on CPU: they come from the profile
    and the device token counts, never from the logits."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    prompts, knobs = PROMPTS[:3], dict(device="cuda", max_model_len=512, max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, seed=3)
    counts = []
    for extra in (dict(dtype="float32", async_scheduling=False, cuda_graphs=False), dict(dtype="bfloat16")):
        llm = LLM("tiny-llama", **knobs, **extra, speculative_config=EAGLE3, acceptance_replay=PROFILE)
        proposer, early = llm.engine.runner.proposer, []
        propose_on_device = proposer.propose_on_device
        proposer.propose_on_device = lambda outcome, p=propose_on_device, e=early: e.append(d := p(outcome)) or d
        llm.engine.metrics = AcceptanceMetrics(traces={})
        llm.generate(prompts, params, use_tqdm=False)
        counts.append(llm.engine.metrics.traces)
    assert counts[0] == counts[1]
    assert sum(d is not None and d.in_table for d in early) >= 10, "drafted behind the verify graph"
