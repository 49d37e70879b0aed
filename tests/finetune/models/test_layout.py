"""The model layer's layout (DESIGN 2): every module lives at one path; the aliases of issue 25 are gone (issue 32),
and the names that moved between modules are found where they live now. The import graph of the whole toolkit
(circles, layers, old paths anywhere in the repository) is checked by ``tests/test_import_graph.py``."""

from __future__ import annotations

import importlib

import pytest

from tests.test_old_paths import OLD_PATHS

#: the module paths of issue 25's aliases -> the module that holds the code (from the table of old paths)
REMOVED = {old: new for old, new in OLD_PATHS.items() if old.startswith("finetune.models.") and new.startswith(
    "finetune.models.")}


@pytest.mark.parametrize("old", sorted(REMOVED))
def test_an_old_module_path_is_gone_and_its_module_is_at_the_new_one(old: str) -> None:
    assert len(REMOVED) == 11
    with pytest.raises(ModuleNotFoundError, match=old.replace(".", r"\.")):
        importlib.import_module(old)
    assert importlib.import_module(REMOVED[old]).__name__ == REMOVED[old]


def test_names_that_moved_between_modules_are_found_only_where_they_live() -> None:
    from finetune.models import DualEncoder, TokenizedText, adapters, finetuned, registry
    from finetune.models.backends import openclip
    from finetune.models.core.tokens import TokenizedText as in_tokens

    assert TokenizedText is in_tokens and DualEncoder.__module__ == "finetune.models.core.encoder"
    for name in ("save_finetuned", "load_finetuned", "read_info", "INFO_NAME", "FORMAT_VERSION"):
        assert hasattr(finetuned, name) and not hasattr(adapters, name), name
    for name in ("TIMM_TINY_SIGLIP", "register_tiny_timm_siglip"):
        assert hasattr(openclip, name) and not hasattr(registry, name), name
    # the tables computed for code older than issue 25 are gone: the registry is finetune.plugins.NAMED_CONFIGS
    for name in ("REGISTRY", "ALIASES", "FAMILY_CONFIGS"):
        assert not hasattr(registry, name), name
    assert registry.named_config("ViT-B/16").name == "clip-vit-base-patch16"
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        registry.nothing  # noqa: B018
