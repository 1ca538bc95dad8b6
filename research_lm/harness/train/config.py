"""The knobs every trainer shares: optimisation, schedule, data, checkpoints. Plain dataclass, no Hydra."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

_SAVE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class TrainConfig:
    output_dir: str  # final artifacts (a checkpoint directory the loaders read)
    steps: int = 300
    batch_size: int = 8  # sequences per step
    seq_len: int = 256  # tokens per packed sequence
    lr: float = 3e-3  # peak; linear warmup, then cosine down to lr * min_lr_ratio
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1  # on matrices only; norms, biases and embeddings are not decayed
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # max global grad norm; 0 disables
    log_every: int = 10  # steps between logged train loss / ppl (the mean over the window)
    eval_every: int = 0  # steps between held-out evaluations; 0: only at the end
    eval_batches: int = 4  # held-out batches per evaluation
    save_every: int = 100  # steps between resume checkpoints; 0: only at the end
    keep_checkpoints: int = 2  # newest resume checkpoints kept
    checkpoint_dir: str | None = None  # resume checkpoints; None: <output_dir>_checkpoints
    resume: bool = False  # continue from the newest checkpoint in checkpoint_dir (fresh start if none)
    seed: int = 0
    device: str = "auto"  # auto: cuda when present, else cpu
    autocast: bool = True  # bf16 autocast on CUDA (CPU always trains in fp32)
    save_dtype: str = "float32"  # dtype of the written weights
    # corpus (research_lm.harness.corpus): stdlib sources, optionally pydoc topics; held-out split by document
    corpus_bytes: int | None = None  # stop adding stdlib files after this many characters; None: all
    pydoc: bool = True
    val_percent: float = 2.0  # documents held out for validation, by a hash of their name
    cache_dir: str | None = None  # tokenized-corpus cache; None: ~/.cache/research_lm/tokens
    progress: bool = True  # a progress bar over steps

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "log_every", "eval_batches", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_every", "save_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        if self.lr <= 0 or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"train.lr must be > 0 and train.min_lr_ratio in [0, 1], got {self.lr}, "
                             f"{self.min_lr_ratio}")
        if not 0.0 < self.val_percent < 100.0:
            raise ValueError(f"train.val_percent must be in (0, 100), got {self.val_percent}")
        if self.save_dtype not in _SAVE_DTYPES:
            raise ValueError(f"train.save_dtype must be one of {sorted(_SAVE_DTYPES)}, got {self.save_dtype!r}")

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_checkpoint_dir(self) -> Path:
        if self.checkpoint_dir:
            return Path(self.checkpoint_dir)
        out = Path(self.output_dir)
        return out.with_name(out.name + "_checkpoints")

    @property
    def torch_save_dtype(self) -> torch.dtype:
        return _SAVE_DTYPES[self.save_dtype]
