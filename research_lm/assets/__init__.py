"""The built-in checkpoints (a directory each, listed in README.md) and which built-in head drafts for which
built-in target."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent

# built-in target -> {spec.method: the built-in head trained for it}. A run on that target with that method and
# no head given (spec.model null) drafts with the shipped head instead of training a quick one first
# (research_lm.harness.experiment.with_spec_head); methods missing here still train one on the fly.
SHIPPED_HEADS: dict[str, dict[str, str]] = {
    "tiny-llama": {"eagle3": "tiny-llama-eagle3"},
}


def shipped_head(target: str | Path, method: str | None) -> str | None:
    """The built-in head for `method` on `target` (a built-in name, or the path of a built-in's directory), or
    None when none ships."""
    path = Path(target).expanduser()
    if path.exists():  # an existing path is loaded as that path (models.loader.resolve_model_path), not a name
        name = path.resolve().name if path.resolve().parent == ASSETS else ""
    else:
        name = str(target)
    return SHIPPED_HEADS.get(name, {}).get(method or "")
