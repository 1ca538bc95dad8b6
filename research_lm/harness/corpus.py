"""The corpus every machine has: the running Python's standard library sources and pydoc topics."""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path

_EXCLUDED_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "lib2to3"}


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(limit_bytes: int | None = None) -> list[Path]:
    """Sorted stdlib `.py` files outside tests/idlelib that decode as UTF-8, up to `limit_bytes`."""
    root = stdlib_dir()
    files, total = [], 0
    for path in sorted(_python_files(root)):
        try:
            size = len(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
        files.append(path)
        total += size
        if limit_bytes is not None and total >= limit_bytes:
            break
    return files


def _python_files(root: Path) -> list[Path]:
    """`*.py` under root, not descending into excluded directories (site-packages is most of the tree)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        out += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return out


def pydoc_topics() -> dict[str, str]:
    from pydoc_data.topics import topics

    return dict(sorted(topics.items()))


def corpus_hash(files: list[Path]) -> str:
    """sha256 over the relative names and contents: identifies the corpus a result was measured on."""
    root = stdlib_dir()
    h = hashlib.sha256()
    for path in files:
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]
