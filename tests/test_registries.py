"""One generic registry type serves every extension point: names registered by a decorator or by a lazily imported
module, an unknown name answered with the known ones, plugin modules found through an entry-point group."""

from __future__ import annotations

import pytest

from attention_zoo.registries import Registry, plugin_modules


def test_register_get_and_unknown_names_list_the_known_ones():
    reg: Registry[object] = Registry("widget")

    @reg.register("a", "alias")
    class A:
        pass

    assert reg.get("a") is A and reg.get("alias") is A and "a" in reg and reg.names() == ["a", "alias"]
    with pytest.raises(ValueError, match=r"unknown widget 'b'; choose one of \['a', 'alias'\]"):
        reg.get("b")
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a")(object())


def test_a_lazy_module_is_imported_only_when_its_name_is_asked_for(tmp_path, monkeypatch):
    (tmp_path / "lazy_widget.py").write_text(
        "from tests.test_registries import LAZY\n@LAZY.register('lazy')\ndef make():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "lazy" in LAZY.names() and "lazy" not in LAZY.entries  # listed, not imported
    assert LAZY.get("lazy")() == 1
    with pytest.raises(ValueError, match="'missing' is not installed"):
        LAZY.get("missing")


LAZY: Registry = Registry("widget", {"lazy": "lazy_widget", "missing": "no_such_module_here"})


def test_every_extension_point_is_a_registry():
    from attention_zoo.registry import BACKENDS
    from research_lm.eplb.registry import POLICIES
    from research_lm.harness.experiment import TASKS
    from research_lm.harness.loggers import LOGGERS
    from research_lm.models.registry import MODELS
    from research_lm.worker.spec import PROPOSERS

    for reg in (BACKENDS, POLICIES, TASKS, LOGGERS, MODELS, PROPOSERS):
        assert isinstance(reg, Registry) and reg.names()


def test_plugins_come_from_the_entry_point_group_or_the_checkouts_pyproject():
    assert plugin_modules("research_lm.proposers") == ["spec_decode.proposers"]
    assert plugin_modules("no.such.group") == []
