"""`train_head`: self-distil a speculative-decoding drafter from a frozen target over the corpus.

    train_head("eagle3", TrainConfig(output_dir="outputs/train/eagle3"), target="outputs/train/target",
               head={"draft_vocab_size": 512, "ttt_steps": 3})

Methods are the proposer names (`eagle3`, `eagle`, `medusa`, `draft_model`); `head` holds the
method's own knobs (see each objective's constructor). The corpus is tokenized with the target's
tokenizer; the written directory is what the matching proposer's loader reads.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

import torch

from research_lm.harness.train.artifacts import TrainResult, summarize, write_recipe
from research_lm.harness.train.config import TrainConfig
from research_lm.harness.train.data import PackedData, load_corpus
from research_lm.harness.train.loop import fit
from research_lm.harness.train.regenerate import regenerate_windows
from research_lm.harness.train.teacher import FrozenTarget

# method -> "module:Objective"; an objective takes (target, *method inputs, **head knobs).
_OBJECTIVES = {
    "eagle3": "research_lm.harness.train.eagle3:Eagle3Objective",
    "eagle": "research_lm.harness.train.eagle:EagleObjective",
    "medusa": "research_lm.harness.train.medusa:MedusaObjective",
    "draft_model": "research_lm.harness.train.draft:DraftObjective",
    "mtp": "research_lm.harness.train.mtp:MtpObjective",
}
METHODS = tuple(_OBJECTIVES)
TASKS = {"eagle3": "train_eagle3", "eagle": "train_eagle", "medusa": "train_medusa", "draft_model": "train_draft",
         "mtp": "train_mtp"}


def build_objective(method: str, target: FrozenTarget, data: PackedData, head: dict[str, Any]):
    if method not in _OBJECTIVES:
        raise ValueError(f"unknown head method {method!r}; choose one of {list(METHODS)}")
    module_name, cls_name = _OBJECTIVES[method].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    knobs = [p.name for p in inspect.signature(cls).parameters.values() if p.kind is p.KEYWORD_ONLY]
    unknown = sorted(set(head) - set(knobs))
    if unknown:
        raise ValueError(f"unknown train.head key(s) {unknown} for {method}; valid ones: {knobs}")
    if method == "eagle3":  # the draft vocabulary: the most frequent tokens of the training split
        args = (torch.bincount(data.train_tokens.long(), minlength=target.vocab_size)[: target.vocab_size],)
    elif method == "draft_model":
        from transformers import AutoTokenizer

        args = (AutoTokenizer.from_pretrained(target.path),)
    else:
        args = ()
    return cls(target, *args, **head)


def _regenerate(data: PackedData, target: Path, cfg: TrainConfig, knobs: dict[str, Any] | None) -> dict[str, Any]:
    knobs = dict(knobs or {})
    valid = ("fraction", "temperature", "copies")
    unknown = sorted(set(knobs) - set(valid))
    if unknown:
        raise ValueError(f"unknown train.regenerate key(s) {unknown}; valid ones: {list(valid)}")
    if not knobs.get("fraction"):
        return {}
    return regenerate_windows(data, target, cfg.resolve_device(), fraction=float(knobs["fraction"]),
                              temperature=float(knobs.get("temperature", 0.0)), seed=cfg.seed,
                              copies=knobs.get("copies", 1))


def train_head(method: str, cfg: TrainConfig, *, target: str = "tiny-llama", head: dict[str, Any] | None = None,
               regenerate: dict[str, Any] | None = None, logger: Any = None) -> TrainResult:
    """Distil a `method` drafter from the frozen `target` (a built-in name or a checkpoint directory).

    `regenerate` ({"fraction": f, "temperature": T, "copies": c}) trains on the target's own continuations of that
    share of the windows instead of the corpus text (research_lm.harness.train.regenerate).
    """
    torch.manual_seed(cfg.seed)
    teacher = FrozenTarget(target, cfg.resolve_device())
    corpus = load_corpus(teacher.path, corpus_bytes=cfg.corpus_bytes, pydoc=cfg.pydoc, cache_dir=cfg.cache_dir)
    data = PackedData(corpus, cfg.seq_len, cfg.val_percent)
    if cfg.seq_len > teacher.config.max_position_embeddings:
        raise ValueError(f"train.seq_len ({cfg.seq_len}) exceeds the target's max_position_embeddings "
                         f"({teacher.config.max_position_embeddings})")
    regen = _regenerate(data, teacher.path, cfg, regenerate)
    objective = build_objective(method, teacher, data, dict(head or {}))
    result = fit(objective, data, cfg, logger)
    out = Path(cfg.output_dir)
    objective.save(out, cfg.torch_save_dtype)
    trainable = sum(p.numel() for p in objective.module.parameters() if p.requires_grad)
    target_recipe = teacher.recipe() or {}
    summary = summarize(TASKS[method], cfg, result, corpus, out, trainable,
                        {"method": method, "target": str(teacher.path),
                         "target_corpus_hash": target_recipe.get("corpus_hash"), **regen})
    write_recipe(out, summary, cfg, {"head": dict(head or {}), "regenerate": dict(regenerate or {})})
    return TrainResult(out, summary, result)
