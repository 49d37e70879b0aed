"""The ground floor of registries (finetune/plugins.py): one discovery rule, clear errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from finetune.plugins import Registry, discover_modules, registries


def _package(tmp_path, monkeypatch, name="toyplugins"):
    pkg = tmp_path / name
    (pkg / "inner").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "inner" / "__init__.py").write_text("")
    for rel, entry in (("a.py", "a"), ("inner/b.py", "b"), ("_private.py", "hidden")):
        (pkg / rel).write_text(f"from conftest_registry import REG\nREG.add({entry!r}, {entry!r})\n")
    (tmp_path / "conftest_registry.py").write_text("from finetune.plugins import Registry\nREG = Registry('toy')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_the_first_lookup_imports_every_module_of_the_packages_but_private_ones(tmp_path, monkeypatch):
    name = _package(tmp_path, monkeypatch)
    import conftest_registry

    reg = conftest_registry.REG
    reg.packages = (name,)
    assert reg._entries == {}  # nothing imported before a lookup
    assert reg.names() == ["a", "b"]
    assert reg.get("b") == "b" and "hidden" not in reg


def test_discover_modules_lists_what_it_imported(tmp_path, monkeypatch):
    name = _package(tmp_path, monkeypatch, "toyplugins2")
    assert discover_modules([name]) == [name, f"{name}.a", f"{name}.inner", f"{name}.inner.b"]


def test_an_unknown_name_lists_the_registered_ones_and_the_closest():
    reg = Registry("scorer", recipe_key="eval.scorer")
    reg.add("cosine", object)
    reg.add("grm", int)
    with pytest.raises(KeyError, match=r"eval.scorer: unknown scorer 'cosin' \(did you mean 'cosine'\?\); "
                                       r"registered: cosine, grm"):
        reg.get("cosin")


def test_a_taken_name_is_refused_unless_replaced_and_the_same_entry_may_register_twice():
    reg = Registry("model family")
    reg.add("hf", dict)
    reg.add("hf", dict)  # a module imported twice
    with pytest.raises(ValueError, match="model family 'hf' is already registered"):
        reg.add("hf", list)
    reg.add("hf", list, replace=True)
    assert reg.get("hf") is list
    with pytest.raises(ValueError, match="needs a non-empty name"):
        reg.add("", list)


def test_plugins_is_the_ground_floor_it_imports_nothing_of_the_toolkit():
    code = ("import sys, finetune.plugins as p; "
            "bad = [m for m in sys.modules if m.startswith(('finetune.', 'losses', 'torch', 'transformers')) "
            "and m != 'finetune.plugins']; print(bad); assert not bad, bad; print(sorted(p.registries()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "TERMS" in out.stdout and "SCORERS" in out.stdout and "MODEL_FAMILIES" in out.stdout
    assert set(registries()) >= {"TERMS", "TERM_OPTIONS", "SCORERS", "MODEL_FAMILIES", "NAMED_CONFIGS",
                                 "INFERENCE_MODULES", "DATA_SOURCES"}


def test_the_toolkits_registries_are_the_ones_their_public_lookups_read():
    import finetune.config as config
    from finetune import plugins
    from finetune.data.sources import available_sources
    from finetune.models.inference_modules import inference_module_names
    from finetune.objectives import TERM_BUILDERS, TERM_OPTIONS
    from finetune.evaluation.scorers import available_scorers

    terms = plugins.TERMS.names()
    assert set(terms) >= {"clip", "siglip", "longclip", "structxlip", "fastgoal", "grm", "flair", "fcast"}
    assert sorted(TERM_BUILDERS) == terms and TERM_OPTIONS is plugins.TERM_OPTIONS
    assert all(TERM_BUILDERS[n] is plugins.TERMS[n].builder for n in terms)
    assert {n: config.registered_term_configs()[n] for n in terms} == {n: plugins.TERMS[n].options for n in terms}
    # (other tests may have registered scorers of their own in this process)
    assert available_scorers() == plugins.SCORERS.names()
    assert {"cosine", "flair", "flair_global", "grm", "grm_ori"} <= set(available_scorers())
    assert sorted(available_sources()) == plugins.DATA_SOURCES.names() and "synthetic" in available_sources()
    assert inference_module_names() == plugins.INFERENCE_MODULES.names()
    assert {"grm.GRMHead", "tsl.heads"} <= set(inference_module_names())


@pytest.mark.slow
def test_config_and_the_objectives_do_not_import_each_other():
    # config asks finetune.plugins for the term options; the registry's first lookup discovers the terms
    config_first = ("import sys, finetune.config as c; print('finetune.objectives' in sys.modules); "
                    "print('structxlip' in c.registered_term_configs())")
    objectives_first = ("import sys, finetune.objectives as o; print('finetune.config' in sys.modules); "
                        "print('structxlip' in o.TERM_BUILDERS)")
    for code in (config_first, objectives_first):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["False", "True"], code


def test_peek_discovers_nothing_and_a_snapshot_restores(tmp_path, monkeypatch):
    name = _package(tmp_path, monkeypatch, "toyplugins3")
    monkeypatch.delitem(sys.modules, "conftest_registry", raising=False)  # a fresh registry, not another test's
    import conftest_registry

    reg = conftest_registry.REG
    reg.packages = (name,)
    assert reg.peek("a") is None and reg.snapshot() == {}  # a register_* helper may check a name mid-import
    assert reg["a"] == "a" and reg.peek("a") == "a"  # indexing is a lookup: it discovered
    saved = reg.snapshot()
    reg.add("c", "c")
    assert reg.names() == ["a", "b", "c"]
    reg.restore(saved)
    assert reg.names() == ["a", "b"]
    with pytest.raises(KeyError, match=r"unknown toy 'c'"):
        reg["c"]
