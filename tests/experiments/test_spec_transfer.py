"""bench_spec_transfer (issue 30) on CPU: the registered table's tiny smoke run end to end, the real-shape drafters'
checkpoints in their published layouts loading through the public API, and the shipped vLLM anchor profile."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

from experiments.paper import TABLES
from research_lm import LLM, SamplingParams
from research_lm.worker.acceptance_replay import expected_tau, load_profile
from tests.experiments.conftest import REPO

sys.path.insert(0, str(REPO / "experiments"))
import bench_spec_transfer as bench  # noqa: E402  (experiments/ is a folder of scripts, not a package)
from bench_common import TINY, model_dir  # noqa: E402

TABLE = "spec_transfer_8b_h200"


def test_the_shipped_anchor_profile_is_vllms_k4_acceptance_length():
    profile = load_profile(str(bench.ANCHOR_PROFILE))
    assert profile == bench.vllm_profile(4)  # the file is what the bench replays at k = 4
    assert expected_tau(profile) == pytest.approx(3.08, abs=1e-9)
    assert profile.num_speculative_tokens == 4 and len(set(profile.per_position)) == 1  # i.i.d.: rates unpublished
    assert "#20780" in profile.source and "MT-bench" in profile.source
    assert [expected_tau(bench.vllm_profile(k)) for k in (3, 5)] == pytest.approx([2.79, 3.32], abs=1e-9)


def test_the_tiny_smoke_run_measures_every_cell_end_to_end(tmp_path):
    """The registered smoke arguments plus ngram and medusa at the shipped K = 4 profile (so their k = 5 cells are
    skipped, naming why): every planned cell has a row per batch size, each speculative row replays its profile
    (marked on every output, tau beside the profile's), and the table and JSON are written."""
    anchor = str(bench.ANCHOR_PROFILE)
    argv = [*TABLES[TABLE].smoke, "--repeats", "1", "--out", str(tmp_path), "--cache-dir", str(tmp_path / "cache"),
            "--ngram-profile", anchor, "--medusa-profile", anchor]
    assert TABLES[TABLE].bench == "bench_spec_transfer" and TABLES[TABLE].device == "cuda"
    payload = bench.main(argv)
    rows = {(r["method"], int(r["k"]), int(r["batch"])): r for r in payload["rows"]}
    expect = {("plain", 0, b) for b in (1, 2)} | {("eagle3", 4, 1)} | {
        (m, k, b) for m in ("eagle3", "draft_model", "ngram", "medusa") for k in (3, 5) for b in (1, 2)}
    assert set(rows) == expect
    for (method, k, _), r in rows.items():
        if method == "plain":
            assert r["tpot_ms"] > 0 and "tau" not in r and "speedup" not in r
        elif method in ("ngram", "medusa") and k == 5:
            assert r["error"].startswith("skipped: profile") and "4 draft positions" in r["error"]
        else:
            assert "error" not in r, r
            assert r["acceptance"].startswith("replayed(vLLM issue #20780") and r["speedup"] > 0
            at_k4 = expected_tau(bench.vllm_profile(4), k)  # ngram and medusa: the shipped K = 4 profile, truncated
            assert r["expected_tau"] == pytest.approx(bench.VLLM_EAGLE3[k][0] if method in ("eagle3", "draft_model")
                                                      else at_k4)
            assert 1 <= r["tau"] <= k + 1 and 0 < r["drafts_per_step"] <= k
            if method != "ngram":  # a model-based drafter drafts k every step
                assert r["drafts_per_step"] == k
    table = (tmp_path / "bench_spec_transfer_tiny.md").read_text()
    assert "| 1 | eagle3 | 3 | replayed(vLLM #20780 K=3) |" in table
    assert "| 4 | 7.07 → 4.05 | 1.75 | 3.08 |" in table  # the anchor beside our batch-1 k = 4 row
    assert json.loads((tmp_path / "bench_spec_transfer_tiny.json").read_text())["profiles"]["vLLM #20780 K=4"] == (
        bench.vllm_source(4))


def test_an_eagle3_head_of_a_given_shape_loads_in_the_published_layout(tmp_path):
    """A head for a target of 8 layers (vLLM's default aux layers (2, 4, 5) then apply, as for the 8B): the
    safetensors file holds the published names and shapes, loads through `LLM`, drafts over its draft vocabulary
    (d2t), and replays the profile it is given. A second write reuses the directory."""
    shape = dict(TINY, hidden_size=96, intermediate_size=160, num_hidden_layers=8, num_attention_heads=6,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=False)
    config, shapes = bench.eagle3_config(shape, 200), bench.eagle3_shapes(shape, 200)
    maps = bench.draft_vocab_maps(512, 200)
    head = bench.write_random_checkpoint(tmp_path, "eagle3", config, shapes, "model.safetensors", torch.float32,
                                         torch.device("cpu"), maps)
    tensors = load_file(str(head / "model.safetensors"))
    assert {n: tuple(t.shape) for n, t in tensors.items()} == shapes | {"d2t": (200,), "t2d": (512,)}
    assert tensors["fc.weight"].shape == (96, 3 * 96) and tensors["midlayer.self_attn.q_proj.weight"].shape == (96, 192)
    assert tensors["t2d"].dtype == torch.bool and int(tensors["t2d"].sum()) == 200
    assert "eagle_aux_hidden_state_layer_ids" not in json.loads((head / "config.json").read_text())
    stamp = os.stat(head / "model.safetensors").st_mtime_ns
    assert bench.write_random_checkpoint(tmp_path, "eagle3", config, shapes, "model.safetensors", torch.float32,
                                         torch.device("cpu"), maps) == head
    assert os.stat(head / "model.safetensors").st_mtime_ns == stamp

    llm = LLM(model_dir(shape), load_format="dummy", dtype="float32", device="cpu", attention_backend="torch_ref",
              max_model_len=128, max_num_seqs=2,
              speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 3},
              acceptance_replay=bench.vllm_profile(3).to_dict())
    proposer = llm.engine.runner.proposer
    assert proposer.aux_hidden_state_layers == (2, 4, 5)
    ids = torch.arange(200) + tensors["d2t"]
    assert torch.equal(proposer.head.draft_to_target.cpu(), ids) and bool(tensors["t2d"][ids].all())
    outputs = llm.generate([[1, 2, 3, 4] * 4, [5, 6, 7] * 5], SamplingParams(temperature=0.0, max_tokens=12,
                                                                           ignore_eos=True), use_tqdm=False)
    assert all(o.acceptance_replayed == bench.vllm_source(3) and len(o.outputs[0].token_ids) == 12 for o in outputs)
    assert sum(o.metrics.num_draft_tokens for o in outputs) > 0
