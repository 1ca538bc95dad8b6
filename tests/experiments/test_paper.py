"""experiments/paper: one command per committed table, median and spread over repeats, GPU tables refuse on CPU."""

from __future__ import annotations

import json

import pytest

import experiments.paper as paper
from research_lm.harness.report import (
    Cell,
    aggregate_records,
    build_report,
    collect,
    fmt_spread,
    group_repeats,
    swept_keys,
)

from .conftest import REPO, run_module

bench_common = paper.import_bench("bench_common")
aggregate, cell = bench_common.aggregate, bench_common.cell

PROSE = {"PERFORMANCE"}  # committed markdown that is an essay, not a table


def test_every_committed_table_has_a_paper_command():
    tables = {p.stem for p in (REPO / "experiments" / "results").glob("*.md")} - PROSE
    assert tables, "no committed tables found"
    assert sorted(tables - set(paper.TABLES)) == [], "a committed table without a paper command"
    listing = paper.listing()
    for name, table in paper.TABLES.items():
        assert table.device in ("cpu", "cuda") and table.measured_on and table.minutes
        assert (table.bench is None) != (not table.sweep), f"{name}: a benchmark or a sweep, not both"
        if table.bench:
            assert (REPO / "experiments" / f"{table.bench}.py").is_file()
        assert f"`python -m experiments.paper {name}`" in listing
    readme = (REPO / "experiments" / "paper" / "README.md").read_text()
    assert listing in readme, "experiments/paper/README.md's table is `python -m experiments.paper --list`"


def test_median_and_min_max_spread_of_fabricated_repeats():
    repeats = [
        [{"variant": "a", "ms": 3.0, "steps": 7, "note": "x", "stages_ms": {"fwd": 1.0}},
         {"variant": "b", "ms": 10.0}],
        [{"variant": "b", "ms": 30.0}, {"variant": "a", "ms": 1.0, "steps": 7, "note": "y", "stages_ms": {"fwd": 3.0}}],
        [{"variant": "a", "ms": 2.0, "steps": 7, "stages_ms": {"fwd": 2.0}}, {"variant": "b", "error": "OOM"}],
    ]  # fmt: skip
    a, b = aggregate_records(repeats, ("variant",))
    assert a["variant"] == "a" and a["ms"] == 2.0 and a["spread"]["ms"] == [1.0, 3.0]
    assert a["repeats"]["ms"] == [3.0, 1.0, 2.0] and a["num_repeats"] == 3
    assert a["steps"] == 7 and a["spread"]["steps"] == [7, 7] and a["note"] == "x"  # first repeat's text
    assert a["stages_ms"] == {"fwd": 2.0} and a["spread"]["stages_ms.fwd"] == [1.0, 3.0]
    assert b["ms"] == 20.0 and b["spread"]["ms"] == [10.0, 30.0]  # even count: mean of the middle two
    assert b["num_repeats"] == 2 and b["errors"] == ["OOM"]  # the failed repeat is not a value

    assert fmt_spread(2.0, [1.0, 3.0], ".1f") == "2.0 (1.0–3.0)"
    assert fmt_spread(0.9021, [0.90205, 0.90214], ".3f") == "0.902"  # equal at the shown precision: no spread
    assert cell(a, "ms", ".0f", lambda v: 1e3 / v) == "500 (333–1000)"  # a derived column keeps min <= max


def test_bench_payloads_aggregate_rows_and_top_level_ceilings():
    payloads = [{"env": {"device": "X"}, "copy_tb_s": bw, "rows": [{"policy": "lpt", "ms_median": ms}]}
                for bw, ms in ((4.0, 9.0), (4.2, 8.0), (4.1, 7.0))]
    out = aggregate(payloads, ("policy",))
    assert out["copy_tb_s"] == 4.1 and out["spread"]["copy_tb_s"] == [4.0, 4.2] and out["num_repeats"] == 3
    assert out["rows"][0]["ms_median"] == 8.0 and len(out["repeats_raw"]) == 3
    assert "env" not in out["repeats_raw"][0] and out["env"] == {"device": "X"}


def _job(root, name, repeat, ms, balance, seed=0, spec="ngram"):
    job = root / name
    job.mkdir(parents=True)
    (job / "results.json").write_text(json.dumps({
        "summary": {"output_throughput_tok_s": ms, "speedup": balance},
        "config": {"task": "generate", "seed": seed},
        "reproducibility": {"overrides": [f"spec={spec}", f"+repeat={repeat}", f"seed={seed}"]},
        "baseline": {"summary": {"output_throughput_tok_s": 2 * ms}, "overrides": {"spec": "none"}},
    }))


def test_report_groups_jobs_that_differ_only_in_the_repeat_key(tmp_path):
    for i, (spec, r, v) in enumerate([("ngram", 0, 10.0), ("ngram", 1, 30.0), ("ngram", 2, 20.0),
                                      ("eagle3", 0, 5.0), ("eagle3", 1, 5.0), ("eagle3", 2, 6.0)]):
        _job(tmp_path, str(i), r, v, 1.5, spec=spec)
    jobs = collect(tmp_path)
    cells, keys = group_repeats(jobs, swept_keys(jobs))
    assert keys == ["spec"] and [len(c.jobs) for c in cells] == [3, 3] and all(isinstance(c, Cell) for c in cells)
    assert cells[0].summary["output_throughput_tok_s"] == 20.0
    assert cells[0].spread["output_throughput_tok_s"] == [10, 30]
    assert cells[0].results["baseline"]["summary"]["output_throughput_tok_s"] == 40.0
    text = build_report(tmp_path, plots=False).read_text()
    assert "| jobs | `spec` |" in text and "| 0,1,2 | ngram | 20 (10–30) | 1.5 |" in text
    assert "| 0,1,2 baseline (spec=none) |  | 40 (20–60) |" in text and "| 3,4,5 | eagle3 | 5 (5–6) |" in text
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["repeat_key"] == "repeat" and data["cells"][1]["repeats"]["output_throughput_tok_s"] == [5, 5, 6]

    # a seed sweep: the same jobs, grouped by seed instead (here every job has seed 0: nothing to group)
    assert group_repeats(jobs, swept_keys(jobs), repeat_key="seed")[0] is jobs


def test_gpu_tables_refuse_on_a_cpu_with_a_clear_message(monkeypatch, capsys):
    from experiments.paper.__main__ import main

    monkeypatch.setattr(paper, "cuda_available", lambda: False)
    gpu = [name for name, t in paper.TABLES.items() if t.device == "cuda"]
    assert {"bench_decode", "bench_throughput", "bench_attention", "spec_eagle3_tiny_h200"} <= set(gpu)
    for name in gpu:
        with pytest.raises(paper.PaperError, match=rf"^{name}: needs a CUDA GPU \(measured on .*H[12]00"):
            paper.run(name)
    assert main(["bench_decode"]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU (measured on NVIDIA H200)" in err and "--allow-cpu" in err
    with pytest.raises(paper.PaperError, match="no CPU smoke run"):
        paper.resolve("bench_attention", allow_cpu=True)
    assert paper.resolve("bench_decode", allow_cpu=True)[1] is True  # the smoke variant
    with pytest.raises(paper.PaperError, match="repeats must be >= 3"):
        paper.run("eplb_policy", repeats=2)
    with pytest.raises(paper.PaperError, match="unknown table 'nope'; choose one of: bench_decode"):
        paper.run("nope")


def test_later_overrides_replace_earlier_ones():
    assert paper.merge_overrides(("device=cuda", "logger=jsonl"), ("device=cpu",), ("x.y=1",)) == [
        "device=cpu", "logger=jsonl", "x.y=1"]


def test_a_cpu_table_regenerates_end_to_end_at_a_tiny_size(tmp_path):
    """eplb_ablation_cpu: the Hydra sweep x 3 repeats, the report over repeats, the table, JSON and plot."""
    proc = run_module("experiments.paper", "eplb_ablation_cpu", "--out", str(tmp_path / "results"),
                      "--sweep-dir", str(tmp_path / "multirun"), "--", "eplb_replay.record_model=null",
                      "eplb_replay.synthetic.num_steps=30", "eplb_replay.policies=[none,lpt]", cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    md = (tmp_path / "results" / "eplb_ablation_cpu.md").read_text()
    assert "`python -m experiments.paper eplb_ablation_cpu`" in md and "1 cell(s) x 3 repeat(s)" in md
    assert "+repeat=0,1,2" in md and "min–max" in md and "| zipf | lpt |" in md
    data = json.loads((tmp_path / "results" / "eplb_ablation_cpu.json").read_text())
    assert data["command"].startswith("python -m experiments.paper eplb_ablation_cpu")
    env = data["env"]
    assert env["device"] == "cpu" and env["packages"]["torch"] and {"commit", "dirty"} <= set(env["git"])
    assert env["date"] and env["command"].startswith("python -m research_lm -m experiment=eplb_ablation")
    rows = data["report"]["cells"][0]["rows"]
    assert [r["policy"] for r in rows] == ["none", "lpt"] and all(len(r["repeats"]["rebalance_ms_median"]) == 3
                                                                   for r in rows)
    assert (tmp_path / "results" / "eplb_ablation_cpu.png").read_bytes()[:4] == b"\x89PNG"


def test_sweep_parts_run_side_by_side_with_gpus(tmp_path, monkeypatch):
    """--gpus 2: both parts run at once (each logged beside its folder) and land in one table."""
    import dataclasses

    monkeypatch.chdir(REPO)
    base = paper.TABLES["eplb_ablation_cpu"]
    table = dataclasses.replace(base, parts=(("eplb_replay.policies=[none]",), ("eplb_replay.policies=[lpt]",)))
    overrides = paper.merge_overrides(base.sweep, ("eplb_replay.record_model=null",
                                                   "eplb_replay.synthetic.num_steps=30"))
    md = paper.run_sweep(table, "eplb_ablation_cpu", overrides, repeats=3, out=tmp_path, file_name="t",
                         sweep_root=tmp_path / "multirun", gpus=2)
    logs = sorted((tmp_path / "multirun" / "t").glob("*/part*.log"))
    assert [p.name for p in logs] == ["part0.log", "part1.log"]
    text = md.read_text()
    assert "| zipf | none |" in text and "| zipf | lpt |" in text and "3 repeat(s)" in text


def test_printed_sweep_commands_run_elsewhere_then_write_the_table(tmp_path, monkeypatch):
    """--print-commands gives the part commands; after they ran, --from-sweep writes the table from the folder."""
    import shlex
    import subprocess
    import sys

    monkeypatch.chdir(REPO)
    extra = ("eplb_replay.record_model=null", "eplb_replay.synthetic.num_steps=30", "eplb_replay.policies=[lpt]")
    proc = run_module("experiments.paper", "eplb_ablation_cpu", "--print-commands", "--sweep-dir",
                      str(tmp_path / "sweep"), "--", *extra, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (line,) = proc.stdout.strip().splitlines()
    argv = shlex.split(line)
    assert argv[:4] == ["python", "-m", "research_lm", "-m"] and f"hydra.sweep.dir={tmp_path / 'sweep'}" in argv
    assert subprocess.run([sys.executable, *argv[1:]], cwd=REPO, capture_output=True).returncode == 0
    md = paper.table_from_sweep("eplb_ablation_cpu", tmp_path / "sweep", out=tmp_path, extra=extra)
    text = md.read_text()
    assert "| zipf | lpt |" in text and "--from-sweep" in text and "3 repeat(s)" in text


def test_bench_decode_takes_the_8b_shape_and_batches_without_building_it():
    """--shape llama-3.1-8b maps to the Llama-3.1-8B config (never built on a CPU here); --batch takes one or
    more sizes; the default (1B, batch 1) keeps its file name, others get their own."""
    bench = paper.import_bench("bench_decode")
    args = bench.parser().parse_args(["--shape", "llama-3.1-8b", "--batch", "64"])
    shape = bench.bench_shape(args)
    assert shape is bench_common.LLAMA_3_1_8B and args.batch == [64]
    assert (shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]) == (4096, 14336, 32)
    assert (shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]) == (32, 8, 128)
    assert (shape["vocab_size"], shape["tie_word_embeddings"]) == (128256, False)
    assert (shape["max_position_embeddings"], shape["rms_norm_eps"], shape["bos_token_id"], shape["eos_token_id"]) == (
        131072, 1e-5, 128000, 128001)
    assert shape["rope_parameters"] == dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                            high_freq_factor=4.0, original_max_position_embeddings=8192)
    assert bench.kv_bytes_per_step(shape, 64, 1000, bench.torch.bfloat16) == 64 * 1000 * 32 * 2 * 8 * 128 * 2
    assert bench.default_name(args) == "bench_decode_8b_b64"
    default = bench.parser().parse_args([])
    assert bench.bench_shape(default) is bench_common.LLAMA_3_2_1B and default.batch == [1]
    assert bench.default_name(default) == "bench_decode"
    table = bench.parser().parse_args(list(paper.TABLES["bench_decode_8b"].args))  # what the paper entry runs
    assert (table.shape, table.batch, table.steps) == ("llama-3.1-8b", [1, 64], 32)
    with pytest.raises(SystemExit):
        bench.main(["--batch", "0"])


def test_bench_decode_batch_2_on_a_cpu(tmp_path):
    """--batch 2 --tiny: two requests decode together; the floor adds their KV read; tok/s counts both."""
    bench = paper.import_bench("bench_decode")
    payload = bench.main(["--tiny", "--device", "cpu", "--backend", "torch_ref", "--dtype", "float32", "--batch",
                          "2", "--steps", "3", "--warmup", "1", "--prompt-len", "8", "--hf-dynamic-steps", "8",
                          "--skip-hf-static", "--repeats", "1", "--out", str(tmp_path)])  # fmt: skip
    rows = {r["variant"]: r for r in payload["rows"]}
    assert payload["batches"] == [2] and all(r["batch"] == 2 for r in rows.values())
    floor = rows["floor: (weight + KV bytes) / copy bandwidth"]
    context = 8 + 1 + 1 + (3 - 1) / 2  # prompt + first token + warmup + the mean of the measured steps
    assert floor["kv_bytes"] == 2 * context * 2 * 2 * 2 * 16 * 4  # batch x context x layers x K,V x heads x dim x fp32
    eager = rows["research_lm eager"]
    assert eager["ms"] > 0 and rows["transformers dynamic cache"]["ms"] > 0
    assert rows["transformers static cache (compiled)"]["error"] == "skipped (--skip-hf-static)"
    md = (tmp_path / "bench_decode_b2_tiny.md").read_text()
    assert "Batch-2 decode, tiny shape" in md
    assert f"| research_lm eager | {eager['ms']:.3f} | {2e3 / eager['ms']:.0f} |" in md  # tok/s: both requests


def test_bench_decode_8b_table_smoke_runs_both_batches_on_a_cpu(tmp_path):
    """The bench_decode_8b entry (batch 1 and 64 on a GPU) as its CPU smoke run: tiny, batch 1 and 2, one table."""
    md = paper.run("bench_decode_8b", allow_cpu=True, out=tmp_path).read_text()
    assert "Decode at batch 1, 2, tiny shape" in md and "| batch | variant | ms/step | tok/s |" in md
    assert "| 1 | floor: (weight + KV bytes) / copy bandwidth |" in md and "| 2 | research_lm eager |" in md
    assert "| 2 | transformers dynamic cache |" in md


def test_a_bench_table_prepares_its_missing_models_first_and_names_a_failure(monkeypatch, tmp_path):
    import dataclasses
    import types

    table = dataclasses.replace(paper.TABLES["bench_prefill"], prepare=(str(tmp_path / "missing"), ("train",)))
    monkeypatch.setattr(paper, "resolve", lambda name, allow_cpu: (table, False))
    calls, code = [], [0]
    monkeypatch.setattr(paper.subprocess, "run",
                        lambda cmd, env: calls.append(cmd) or types.SimpleNamespace(returncode=code[0]))
    monkeypatch.setattr(paper, "run_bench", lambda bench, args, **kw: calls.append((bench, args[:2])) or tmp_path)
    paper.run("bench_prefill", out=tmp_path)
    assert calls == [["train"], ("bench_prefill", ["--model", "outputs/reference/target"])]
    code[0] = 1
    with pytest.raises(paper.PaperError, match="preparing .*missing failed"):
        paper.run("bench_prefill", out=tmp_path)


def test_tensor_parallel_tables_run_under_torchrun_and_want_their_gpus(tmp_path, monkeypatch):
    """A ranks = 2 table starts its benchmark under torchrun (here its CPU smoke run: two gloo ranks, rank 0 writes
    the table) and refuses on a machine with fewer GPUs, naming how many it needs."""
    md = paper.run("bench_tensor_parallel_8b_h200x2", allow_cpu=True, out=tmp_path).read_text()
    assert "2 ranks (torchrun)" in md and "| 2 | research_lm TP = 2 |" in md and "| 1 | floor at TP = 2 |" in md
    monkeypatch.setattr(paper, "cuda_available", lambda: True)
    monkeypatch.setattr(paper, "cuda_device_count", lambda: 1)
    with pytest.raises(paper.PaperError, match=r"needs 2 CUDA GPUs \(measured on 2 x NVIDIA H200\); 1 found here"):
        paper.resolve("bench_tensor_parallel_70b32l_h200x2")


def test_bench_invariant_gemm_compares_the_kernels_and_checks_rows_on_a_cpu(tmp_path):
    """The invariant GEMM's tuning loop at a tiny shape: every projection at each M, and its first row never moves."""
    bench = paper.import_bench("bench_invariant_gemm")
    payload = bench.main(["--tiny", "--device", "cpu", "--dtype", "float32", "--m", "1", "5", "--repeats", "1",
                          "--out", str(tmp_path)])
    rows = payload["rows"]
    assert {r["layer"] for r in rows} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"}
    assert all(r["cublas_us"] > 0 and r["invariant_us"] > 0 and not r["invariant_row_changes"] for r in rows)
    assert "| down_proj | 64 x 128 | 5 |" in (tmp_path / "bench_invariant_gemm_tiny.md").read_text()


def test_bench_decode_reads_the_peer_probe_in_the_same_command(tmp_path):
    """--peer-gptfast: the probe runs as a subprocess and its JSON line becomes the gpt-fast row; elsewhere than
    batch 1 of the 1B shape, with no probe, or with a failing one, the row says why instead."""
    bench = paper.import_bench("bench_decode")
    probe = tmp_path / "peer.py"
    probe.write_text('import json, os\nprint("compiling...")\nprint(json.dumps({"gptfast_bs1_ms_per_step": 1.25}))\n'
                     'open(os.path.join(os.environ["OUT"], "gptfast.json"), "w").write("{}")\n')
    args = bench.parser().parse_args(["--peer-gptfast", str(probe)])
    assert bench.peer_row(args, 1) == {"batch": 1, "variant": bench.PEER, "ms": 1.25}
    assert "skipped" in bench.peer_row(args, 64)["error"]
    tiny, missing = (bench.parser().parse_args(a) for a in (["--tiny", "--peer-gptfast", str(probe)],
                                                            ["--peer-gptfast", str(tmp_path / "x.py")]))
    assert "skipped" in bench.peer_row(tiny, 1)["error"] and "no probe" in bench.peer_row(missing, 1)["error"]
    probe.write_text("raise SystemExit('no GPU')\n")
    assert "probe failed (rc 1)" in bench.peer_row(args, 1)["error"]
    assert paper.TABLES["bench_decode"].args[-2:] == ("--peer-gptfast", ".peers/peer_gptfast.py")
