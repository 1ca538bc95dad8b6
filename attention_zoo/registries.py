"""One generic registry type for every extension point (attention backends, models, proposers, EPLB policies,
loggers, tasks). It lives in the leaf package so that attention_zoo and research_lm share it without a cycle.

    BACKENDS = Registry("attention backend", {"triton": "attention_zoo.triton_attn"})
    @BACKENDS.register("triton")          # in attention_zoo/triton_attn.py
    BACKENDS.get("triton")                # imports the module on first use; an unknown name lists the known ones

`modules` maps a name to the module whose import registers it, so an optional heavy dependency loads only when its
entry is asked for. `plugins` names an entry-point group: each entry is a module of another package that adds its
names (`add_module` or `register`) when imported, so a plugin package is found without this code naming it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T")
_PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


class Registry(Generic[T]):
    def __init__(self, kind: str, modules: dict[str, str] | None = None, plugins: str | None = None):
        self.kind = kind  # in errors: "unknown <kind> 'x'; choose one of [...]"
        self._modules = dict(modules or {})
        self.entries: dict[str, T] = {}  # what is registered so far (tests may patch it)
        self._plugins = plugins
        self._plugins_loaded = plugins is None

    def register(self, *names: str) -> Callable[[T], T]:
        """A decorator: the object under each of `names` (a second, different object under a name is an error)."""

        def wrap(obj: T) -> T:
            for name in names:
                old = self.entries.get(name, obj)
                if old is not obj and _qualname(old) != _qualname(obj):  # the same definition re-imported is fine
                    raise ValueError(f"{self.kind} {name!r} is already registered")
                self.entries[name] = obj
            return obj

        return wrap

    def add_module(self, name: str, module: str) -> None:
        """`name` is registered by importing `module` (imported when `name` is first asked for)."""
        self._modules[name] = module

    def names(self) -> list[str]:
        self._load_plugins()
        return sorted(set(self._modules) | set(self.entries))

    def __contains__(self, name: str) -> bool:
        return name in self.names()

    def get(self, name: str) -> T:
        if name not in self.entries:
            self._load_plugins()
            if name not in self._modules:
                raise ValueError(f"unknown {self.kind} {name!r}; choose one of {self.names()}")
            try:
                importlib.import_module(self._modules[name])
            except ImportError as e:
                raise ValueError(f"{self.kind} {name!r} is not installed: {e}") from e
            if name not in self.entries:
                raise ValueError(f"{self.kind} {name!r}: {self._modules[name]} did not register it")
        return self.entries[name]

    def _load_plugins(self) -> None:
        if self._plugins_loaded:
            return
        self._plugins_loaded = True
        for module in plugin_modules(self._plugins):
            importlib.import_module(module)


def _qualname(obj: object) -> str:
    return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', id(obj))}"


def plugin_modules(group: str) -> list[str]:
    """The modules of an entry-point group: from the installed distributions, or, in a checkout run from its source
    tree without being installed (the GPU machine's PYTHONPATH copies), from the same table in its pyproject.toml."""
    found = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=group)}
    if not found and _PYPROJECT.is_file():
        found = tomllib.loads(_PYPROJECT.read_text()).get("project", {}).get("entry-points", {}).get(group, {})
    return [value.partition(":")[0] for _, value in sorted(found.items())]
