"""The `baseline:` block of generate: a config group by option name, or merged overrides."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from research_lm.harness.experiment import baseline_config

from .conftest import CONF_DIR


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_group_option_replaces_the_group_and_mappings_merge():
    cfg = _compose("experiment=mla", "+baseline.runner={max_num_seqs: 3}")
    base = baseline_config(cfg)
    assert base.model.random.architecture == "LlamaConfig"
    assert "kv_lora_rank" not in base.model.random.config  # replaced, not merged
    assert base.runner.max_num_seqs == 3 and base.runner.block_size == cfg.runner.block_size
    assert base.baseline is None and base.seed == cfg.seed
    assert base.model.random.seed == cfg.seed  # interpolations still resolve


def test_spec_none_turns_speculation_off():
    base = baseline_config(_compose("experiment=ngram"))
    assert base.spec.method is None and base.spec.num_speculative_tokens == 0


def test_unknown_option_lists_the_valid_ones():
    cfg = _compose("experiment=mla", "baseline.model=nope")
    with pytest.raises(ValueError, match="random-llama"):
        baseline_config(cfg)
