"""A tiny target trained by `train_target` (once per session) and the knobs every trainer test shares.

The corpus is a ~30 kB slice of the stdlib (no pydoc), tokenized with the built-in tiny-llama tokenizer
(vocab 1024) into a per-session cache; the target is a 4-layer Llama of hidden size 32.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from research_lm.harness.train import TrainConfig, train_target

TINY_TARGET = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                   num_key_value_heads=1)
VOCAB = 1024


class Crash(Exception):
    pass


class CrashAt:
    """A run logger that dies when asked to log the train metrics of `step` (a preempted job, say)."""

    def __init__(self, step: int):
        self.step = step

    def log(self, metrics, step):
        if step == self.step and "train/loss" in metrics:
            raise Crash


@pytest.fixture(scope="session")
def train_kwargs(tmp_path_factory) -> dict:
    """TrainConfig knobs for a few-second CPU run (pass output_dir and steps)."""
    cache = tmp_path_factory.mktemp("token_cache")
    return dict(batch_size=2, seq_len=32, lr=3e-3, warmup_steps=2, log_every=1, save_every=3, eval_batches=2,
                corpus_bytes=30_000, pydoc=False, cache_dir=str(cache), progress=False, device="cpu")


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory, train_kwargs) -> Path:
    out = tmp_path_factory.mktemp("target") / "target"
    train_target(TrainConfig(output_dir=str(out), steps=4, **train_kwargs), model=TINY_TARGET)
    return out
