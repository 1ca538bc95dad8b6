"""Hugging Face checkpoint directory -> our model, on a device, in a dtype, in eval mode.

Checkpoints are data, never code: safetensors first (single file or sharded with an index);
`pytorch_model*.bin` only through `torch.load(..., weights_only=True)`; `trust_remote_code` only
when the caller turns it on. Every problem with the directory raises `CheckpointError` naming it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from research_lm.models.base import CheckpointError, ModelBuildContext
from research_lm.models.registry import resolve_architecture
from research_lm.worker.parallel import TensorParallel

if TYPE_CHECKING:
    from transformers import PretrainedConfig

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_SAFETENSORS_INDEX = "model.safetensors.index.json"
_BIN_INDEX = "pytorch_model.bin.index.json"


def builtin_models() -> list[str]:
    """Names of the checkpoints shipped in research_lm/assets/ (directories holding a config.json)."""
    if not ASSETS_DIR.is_dir():
        return []
    return sorted(p.name for p in ASSETS_DIR.iterdir() if (p / "config.json").is_file())


def resolve_model_path(name_or_path: str | Path) -> Path:
    """An existing path as-is; otherwise a built-in name under research_lm/assets/."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    builtins = builtin_models()
    if str(name_or_path) in builtins:
        return ASSETS_DIR / str(name_or_path)
    raise CheckpointError(
        f"model {str(name_or_path)!r} is neither an existing directory nor a built-in model "
        f"(no model hub is reached); built-ins: {builtins or 'none'}"
    )


def read_json_config(path: Path) -> dict[str, Any]:
    """The directory's config.json as plain JSON (a speculative head's, which transformers may not know)."""
    f = path / "config.json"
    try:
        cfg = json.loads(f.read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"{path} has no config.json") from e
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {f}: {e}") from e
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{f} does not hold a JSON object")
    return cfg


def load_config(path: str | Path, trust_remote_code: bool = False) -> PretrainedConfig:
    """The directory's config.json as a transformers config."""
    path = _checked_dir(path)
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"cannot read {path / 'config.json'}: {e}") from e


def load_model(
    path: str | Path,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    attention_backend: str,
    trust_remote_code: bool = False,
    extra: dict[str, Any] | None = None,
    load_format: str = "auto",
    tp: TensorParallel | None = None,
) -> tuple[nn.Module, PretrainedConfig]:
    """Build the registered model for the checkpoint at `path` and load its weights (no grad, eval); with `tp`,
    this rank's share of them, each layer's loader slicing the full checkpoint tensors.

    load_format "dummy" (vLLM's name) draws random weights instead (`init_random_weights`): `path`
    then needs only a config.json. For speed runs of real shapes without the weights."""
    path = _checked_dir(path)
    hf_config = load_config(path, trust_remote_code)
    try:
        resolve_architecture(hf_config)
    except ValueError as e:
        raise CheckpointError(f"{path / 'config.json'}: {e}") from e
    model = build_model(hf_config, device=device, dtype=dtype, attention_backend=attention_backend, extra=extra,
                        tp=tp)
    if load_format == "dummy":
        init_random_weights(model)
        return model, hf_config
    with torch.no_grad():
        loaded = model.load_weights(iter_checkpoint(checkpoint_files(path)))
    missing = sorted(name for name, _ in model.named_parameters() if name not in loaded)
    if missing:
        raise CheckpointError(
            f"checkpoint {path} lacks {len(missing)} tensors the model needs, e.g. {missing[:5]}"
        )
    return model, hf_config


def build_model(
    hf_config: PretrainedConfig,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    attention_backend: str,
    extra: dict[str, Any] | None = None,
    tp: TensorParallel | None = None,
) -> nn.Module:
    """The registered model for `hf_config` on `device` in `dtype`, eval, no grad, weights uninitialized:
    load them (`model.load_weights`) or draw them (`init_random_weights`, for speed runs). With `tp`, this
    tensor-parallel rank's share of the layers."""
    _, model_cls = resolve_architecture(hf_config)
    build = ModelBuildContext(torch.device(device), dtype, attention_backend, dict(extra or {}), tp)
    with torch.no_grad():
        model = model_cls(hf_config, build)
    model.requires_grad_(False)
    return model.eval()


@torch.no_grad()
def init_random_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Weights for speed runs without a checkpoint: N(0, std) matrices, zero biases, unit norm scales.

    Speed does not depend on the values; a family whose parameters need a particular range (e.g. Mamba's
    A_log) defines its own `init_random_weights(generator)` method, which is used instead.
    """
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    if hasattr(model, "init_random_weights"):
        model.init_random_weights(gen)
        return
    for name, param in model.named_parameters():
        if param.dim() >= 2:
            param.normal_(0.0, std, generator=gen)
        else:
            param.fill_(1.0 if "norm" in name else 0.0)


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> Any:
    """The directory's tokenizer through `AutoTokenizer`, or None when it holds no tokenizer files."""
    path = Path(path)
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def checkpoint_files(path: Path) -> list[Path]:
    """The weight files to read, in order: safetensors (indexed or single), else pickled .bin."""
    for index_name in (_SAFETENSORS_INDEX, _BIN_INDEX):
        if (path / index_name).is_file():
            return _indexed_files(path, index_name)
    for pattern in ("model.safetensors", "model*.safetensors", "pytorch_model.bin", "pytorch_model*.bin"):
        files = sorted(path.glob(pattern))
        if files:
            return files
    raise CheckpointError(
        f"no weights in {path}: looked for model.safetensors, {_SAFETENSORS_INDEX}, pytorch_model*.bin"
    )


def _indexed_files(path: Path, index_name: str) -> list[Path]:
    try:
        weight_map = json.loads((path / index_name).read_text())["weight_map"]
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"cannot read the shard index {path / index_name}: {e}") from e
    files = [path / name for name in sorted(set(weight_map.values()))]
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"shard {f.name} named by {index_name} is missing from {path}")
    return files


def iter_checkpoint(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) pairs, one tensor in memory at a time for safetensors."""
    for f in files:
        if f.suffix == ".safetensors":
            yield from _iter_safetensors(f)
        else:
            yield from _iter_pickled(f)


def _iter_safetensors(f: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(f, framework="pt", device="cpu") as reader:
            for name in reader.keys():
                yield name, reader.get_tensor(name)
    except SafetensorError as e:
        raise CheckpointError(f"cannot read {f}: {e}") from e


def _iter_pickled(f: Path) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        state = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # weights_only refuses arbitrary pickles with an UnpicklingError
        raise CheckpointError(f"cannot read {f} as a weights-only torch checkpoint: {e}") from e
    yield from state.items()


def _checked_dir(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"model directory {path} does not exist")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} has no config.json")
    return path
