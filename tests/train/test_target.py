"""train_target: the checkpoint is a standard HF directory our engine serves; training lowers the
loss; a resumed run is bit-identical to an uninterrupted one; data and schedule invariants."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from research_lm import LLM, SamplingParams
from research_lm.harness.corpus import corpus_hash, stdlib_files
from research_lm.harness.train import TrainConfig, train_target
from research_lm.harness.train.data import Corpus, PackedData
from research_lm.harness.train.loop import lr_at
from tests.train.conftest import TINY_TARGET, VOCAB, Crash, CrashAt


def test_checkpoint_is_served_by_llm_like_transformers(tiny_target):
    """LLM(path) loads the trained target and its greedy continuation matches transformers' argmax loop."""
    from transformers import AutoModelForCausalLM

    names = {p.name for p in tiny_target.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "recipe.json"} <= names
    recipe = json.loads((tiny_target / "recipe.json").read_text())
    assert recipe["corpus_hash"] == corpus_hash(stdlib_files(limit_bytes=30_000))
    assert recipe["steps"] == 4 and recipe["seed"] == 0
    assert math.isfinite(recipe["final_train_loss"]) and math.isfinite(recipe["final_val_loss"])

    llm = LLM(str(tiny_target), device="cpu", dtype="float32")
    prompt = llm.get_tokenizer()("def main(")["input_ids"]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    ours = list(out[0].outputs[0].token_ids)

    hf = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(8):
            ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert ours == ids[0, len(prompt):].tolist()


def test_training_lowers_held_out_loss(tmp_path, train_kwargs):
    """40 steps take the held-out loss well below the uniform ln(vocab)."""
    kwargs = {**train_kwargs, "lr": 1e-2, "batch_size": 4, "save_every": 0}
    result = train_target(TrainConfig(output_dir=str(tmp_path / "m"), steps=40, **kwargs), model=TINY_TARGET)
    assert result.summary["final_val_loss"] < math.log(VOCAB) - 1.0
    losses = [h["train/loss"] for h in result.fit.history if "train/loss" in h]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0


def test_resume_matches_uninterrupted_run(tmp_path, train_kwargs):
    """Crash after the step-3 checkpoint, resume: steps 4-6 log the same losses, bit for bit, and the
    final weights are identical to a run that never stopped."""
    full = train_target(TrainConfig(output_dir=str(tmp_path / "a"), steps=6, **train_kwargs), model=TINY_TARGET)
    cfg = TrainConfig(output_dir=str(tmp_path / "b"), steps=6, **train_kwargs)
    with pytest.raises(Crash):
        train_target(cfg, model=TINY_TARGET, logger=CrashAt(5))
    assert [p.name for p in cfg.resolve_checkpoint_dir().glob("*.pt")] == ["step_00000003.pt"]
    cfg.resume = True
    resumed = train_target(cfg, model=TINY_TARGET)
    assert resumed.summary["resumed_from"] == 3

    def train_losses(result, first):
        return {h["step"]: h["train/loss"] for h in result.fit.history if "train/loss" in h and h["step"] >= first}

    assert train_losses(resumed, 4) == train_losses(full, 4)
    assert resumed.summary["final_val_loss"] == full.summary["final_val_loss"]
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_refuses_a_different_data_order(tmp_path, train_kwargs):
    train_target(TrainConfig(output_dir=str(tmp_path / "m"), steps=3, **train_kwargs), model=TINY_TARGET)
    cfg = TrainConfig(output_dir=str(tmp_path / "m"), steps=6, resume=True, **{**train_kwargs, "batch_size": 3})
    with pytest.raises(ValueError, match="batch_size"):
        train_target(cfg, model=TINY_TARGET)


def _corpus(doc_lengths: list[int]) -> Corpus:
    tokens = torch.cat([torch.arange(n, dtype=torch.int32) + 10 * i for i, n in enumerate(doc_lengths)])
    offsets = torch.tensor([0, *doc_lengths]).cumsum(0)
    return Corpus(tokens, offsets, [f"stdlib/doc{i}.py" for i in range(len(doc_lengths))], "h", None, 0)


def test_split_is_by_document_and_stable_as_the_corpus_grows():
    small, large = PackedData(_corpus([40] * 60), 8, 10.0), PackedData(_corpus([40] * 200), 8, 10.0)
    assert 0 < small.num_val_docs < 60
    val_small = {tuple(r.tolist()) for r in small.val}
    assert val_small <= {tuple(r.tolist()) for r in large.val}  # a held-out document stays held out
    assert not val_small & {tuple(r.tolist()) for r in large.train}


def test_batches_are_a_pure_function_of_the_step():
    data = PackedData(_corpus([40] * 30), 8, 10.0)
    n = data.train.shape[0]
    assert torch.equal(data.train_batch(3, 4, seed=1), PackedData(_corpus([40] * 30), 8, 10.0).train_batch(3, 4, 1))
    epoch = torch.cat([data.train_batch(s, 1, seed=1) for s in range(n)])  # one epoch, batch 1
    assert sorted(map(tuple, epoch.tolist())) == sorted(map(tuple, data.train.long().tolist()))
    assert not torch.equal(data.train_batch(0, 4, seed=1), data.train_batch(0, 4, seed=2))


def test_lr_warms_up_then_decays_to_the_floor():
    cfg = TrainConfig(output_dir="unused", steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    lrs = [lr_at(s, cfg) for s in range(101)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[100] == pytest.approx(0.1)
