"""The package entry points: ``finetune.load_model`` / ``load_finetuned`` and the lazy names of
``finetune.models``."""

from __future__ import annotations

import pytest

import finetune
import finetune.models as models
from finetune.models import adapters, finetuned, longclip, registry


def test_top_level_exports() -> None:
    assert finetune.load_model is finetuned.load_model
    assert finetune.load_finetuned is finetuned.load_finetuned
    with pytest.raises(AttributeError, match="no attribute 'load_everything'"):
        finetune.load_everything  # noqa: B018


def test_models_lazy_exports() -> None:
    assert models.apply_kps is longclip.apply_kps and models.stretch_positions is longclip.stretch_positions
    assert models.build_model is registry.build_model and models.TINY_NAMES == registry.TINY_NAMES
    assert models.AdapterConfig is adapters.AdapterConfig
    assert set(models.__all__) >= {"DualEncoder", "load_model", "save_finetuned", "no_weight_decay_names"}
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        models.nothing  # noqa: B018
