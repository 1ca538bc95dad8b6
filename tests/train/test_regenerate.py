"""Training on the target's own continuations: the rewritten windows are the prompt prefix followed by exactly
what `transformers` greedy-generates from it; the others are untouched; the run is reproducible and recorded."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from research_lm.harness.train import TrainConfig, train_head
from research_lm.harness.train.data import PackedData, load_corpus
from research_lm.harness.train.regenerate import regenerate_windows


def _data(tiny_target, train_kwargs) -> PackedData:
    corpus = load_corpus(tiny_target, corpus_bytes=train_kwargs["corpus_bytes"], pydoc=False,
                         cache_dir=train_kwargs["cache_dir"])
    return PackedData(corpus, seq_len=train_kwargs["seq_len"], val_percent=2.0)


def test_rewritten_windows_are_greedy_continuations_of_their_prefix(tiny_target, train_kwargs):
    data = _data(tiny_target, train_kwargs)
    before_train, before_val = data.train.clone(), data.val.clone()
    summary = regenerate_windows(data, tiny_target, torch.device("cpu"), fraction=0.25, temperature=0.0, seed=0)
    changed = (data.train != before_train).any(1).nonzero().flatten().tolist()
    expected = round(before_train.shape[0] * 0.25)
    assert 0 < len(changed) <= expected  # a continuation may happen to equal the corpus text
    assert summary["regen_windows"] == expected + round(before_val.shape[0] * 0.25)
    assert summary["regen_tokens"] > 0 and summary["regen_fraction"] == 0.25
    assert torch.equal(data.train_tokens, data.train.reshape(-1))  # draft-vocabulary statistics follow
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    seq_len = data.seq_len
    for row in changed[:3]:
        # the kept prefix is the corpus text; it ends where the rewrite starts or later
        first = int((data.train[row] != before_train[row]).nonzero()[0])
        assert seq_len // 8 <= first
        for p in range(seq_len // 8, min(first, seq_len // 2) + 1):
            prefix = data.train[row, :p].long()[None]
            out = model.generate(prefix, max_new_tokens=seq_len - p, do_sample=False, min_new_tokens=seq_len - p,
                                 pad_token_id=model.config.eos_token_id)
            if torch.equal(out[0], data.train[row].long()):
                break
        else:
            pytest.fail(f"window {row} is no greedy continuation of any prefix in [seq_len / 8, seq_len / 2]")


def test_regeneration_is_reproducible_and_sampled_rows_differ(tiny_target, train_kwargs):
    a, b, c = (_data(tiny_target, train_kwargs) for _ in range(3))
    regenerate_windows(a, tiny_target, torch.device("cpu"), fraction=0.3, temperature=1.0, seed=1)
    regenerate_windows(b, tiny_target, torch.device("cpu"), fraction=0.3, temperature=1.0, seed=1)
    regenerate_windows(c, tiny_target, torch.device("cpu"), fraction=0.3, temperature=1.0, seed=2)
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert not torch.equal(a.train, c.train)


def test_head_trains_on_regenerated_windows_and_records_it(tiny_target, train_kwargs, tmp_path):
    cfg = TrainConfig(output_dir=str(tmp_path / "h"), steps=2, **train_kwargs)
    result = train_head("eagle3", cfg, target=str(tiny_target), head={"draft_vocab_size": 100},
                        regenerate={"fraction": 0.5, "temperature": 0.0})
    assert result.summary["regen_fraction"] == 0.5 and result.summary["regen_tokens"] > 0
    recipe = json.loads((tmp_path / "h" / "recipe.json").read_text())
    assert recipe["regenerate"] == {"fraction": 0.5, "temperature": 0.0} and recipe["regen_windows"] > 0


def test_copies_append_more_continuations_of_the_same_corpus_prefixes(tiny_target, train_kwargs):
    one, three = _data(tiny_target, train_kwargs), _data(tiny_target, train_kwargs)
    corpus_train, num_val = one.train.clone(), one.val.shape[0]
    a = regenerate_windows(one, tiny_target, torch.device("cpu"), fraction=0.5, seed=0)
    b = regenerate_windows(three, tiny_target, torch.device("cpu"), fraction=0.5, seed=0, copies=3)
    n, chosen = corpus_train.shape[0], a["regen_windows"] - round(num_val * 0.5)
    assert three.train.shape[0] == n + 2 * chosen and three.val.shape[0] == num_val
    assert torch.equal(three.train[:n], one.train) and torch.equal(three.val, one.val)  # copy 0: as copies=1
    assert b["regen_windows"] == a["regen_windows"] + 2 * chosen and b["regen_copies"] == 3
    assert torch.equal(three.train_tokens, three.train.reshape(-1))
    head = one.seq_len // 8  # every version keeps at least this much of its corpus window
    second, third = three.train[n: n + chosen], three.train[n + chosen:]
    for extra in (second, third):
        assert {tuple(w[:head].tolist()) for w in extra} <= {tuple(w[:head].tolist()) for w in corpus_train}
    assert not torch.equal(second, third)  # own prompt lengths: other continuations


@pytest.mark.parametrize("knobs, match", [({"fractoin": 0.5}, "fractoin.*valid ones"),
                                          ({"fraction": 1.5}, "fraction must be in"),
                                          ({"fraction": 0.5, "copies": 0}, "copies must be an integer"),
                                          ({"fraction": 0.5, "temperature": -1.0}, "temperature must be")])
def test_bad_regenerate_knobs_are_named(tiny_target, train_kwargs, tmp_path, knobs, match):
    cfg = TrainConfig(output_dir=str(tmp_path / "x"), steps=1, **train_kwargs)
    with pytest.raises(ValueError, match=match):
        train_head("eagle3", cfg, target=str(tiny_target), regenerate=knobs)
