"""A preset's `gpu:` block: merged when the device resolves to CUDA, except what the command line set."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from research_lm.harness.experiment import apply_gpu_sizes, gpu_entries

from .conftest import CONF_DIR, PRESETS


def _cfg(device: str = "cuda", gpu=...) -> DictConfig:
    if gpu is ...:
        gpu = {"workload": {"num_requests": 64, "max_tokens": 256}, "runner": {"max_num_seqs": 64},
               "attention": {"backend": "triton", "mla_backend": "mla_triton"}, "warmup_requests": 64,
               "model": "random-llama", "baseline": {"runner": {"max_num_seqs": 1}}}
    return OmegaConf.create({
        "device": device, "seed": 0, "warmup_requests": 2, "baseline": None, "gpu": gpu,
        "model": {"name": "tiny-llama", "dtype": "auto"},
        "workload": {"kind": "code", "num_requests": 16, "max_tokens": 48},
        "runner": {"max_num_seqs": 8, "block_size": 16},
        "attention": {"backend": "torch_ref", "mla_backend": "mla_torch_ref"},
    })


def test_cuda_merges_the_block_and_records_it(capsys):
    out = apply_gpu_sizes(_cfg("cuda"), [])
    assert out.workload.num_requests == 64 and out.workload.max_tokens == 256 and out.workload.kind == "code"
    assert out.runner.max_num_seqs == 64 and out.runner.block_size == 16
    assert out.attention.backend == "triton" and out.warmup_requests == 64
    assert out.model.name == "random" and out.model.random.seed == 0  # a group option, as in baseline:
    assert out.baseline.runner.max_num_seqs == 1  # a mapping over a null key
    assert "workload.num_requests" in out.gpu_applied and "model" in out.gpu_applied
    assert "gpu=null" in capsys.readouterr().out
    assert apply_gpu_sizes(out, []) is out  # already decided (a recorded config being reproduced)


def test_auto_follows_cuda_availability():
    assert apply_gpu_sizes(_cfg("auto"), [], cuda=True).workload.num_requests == 64
    assert apply_gpu_sizes(_cfg("auto"), [], cuda=False).workload.num_requests == 16


def test_cpu_and_gpu_null_leave_the_config_unchanged():
    for cfg in (_cfg("cpu"), _cfg("cuda", gpu=None)):
        out = apply_gpu_sizes(cfg, [])
        assert out.gpu_applied == []
        del out.gpu_applied
        assert out == cfg


def test_command_line_keys_and_groups_are_kept():
    out = apply_gpu_sizes(_cfg("cuda"), ["workload.max_tokens=8", "attention=torch_ref", "+model.revision=x",
                                         "experiment=mla", "hydra.run.dir=/tmp/x"])
    assert out.workload.max_tokens == 48 and out.workload.num_requests == 64  # the user's key; the rest merged
    assert out.attention.backend == "torch_ref" and out.attention.mla_backend == "mla_torch_ref"  # the group
    assert out.model.name == "tiny-llama"  # a key under a group keeps the gpu: option from replacing it
    assert "workload.max_tokens" not in out.gpu_applied and "runner.max_num_seqs" in out.gpu_applied


def test_unknown_keys_and_options_are_refused():
    with pytest.raises(ValueError, match="workload.num_reqests"):
        apply_gpu_sizes(_cfg("cuda", gpu={"workload": {"num_reqests": 1}}), [])
    with pytest.raises(ValueError, match="unknown model"):
        apply_gpu_sizes(_cfg("cuda", gpu={"model": "no-such-model"}), [])


def _leaves(node, prefix=""):
    for key, value in node.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


@pytest.fixture(scope="module")
def composed():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return {name: compose("config", overrides=[f"experiment={name}"]) for name in PRESETS}


def test_every_gpu_block_names_keys_of_its_preset(composed):
    with_block = [name for name, cfg in composed.items() if cfg.gpu]
    expected = {"mla", "sliding_window", "mamba", "attention_ablation", "eagle3", "ngram", "train_target"}
    assert expected <= set(with_block)
    for name in with_block:
        cfg = composed[name]
        gpu_entries(cfg)  # raises on an unknown key or group option
        for path, _ in _leaves(OmegaConf.to_container(cfg.gpu, resolve=False)):
            parent, _, key = path.rpartition(".")
            node = OmegaConf.select(cfg, parent) if parent else cfg
            assert isinstance(node, DictConfig) and key in node, f"{name}: gpu.{path} is not a key of the config"
        text = (CONF_DIR / "experiment" / f"{name}.yaml").read_text()
        assert "applied automatically when the device is CUDA" in text, f"{name}: the header says so"
        merged = apply_gpu_sizes(cfg, [], cuda=True)
        OmegaConf.to_container(merged, resolve=True)  # still resolves (e.g. a group option's ${seed})
