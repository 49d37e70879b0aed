"""xlipkit's toolkit: models, data, objectives, training, evaluation and hub.

``from finetune import load_model, load_finetuned`` (imported lazily, so that ``import finetune``
stays cheap)."""

from __future__ import annotations

from typing import Any

__all__ = ["load_model", "load_finetuned"]


def __getattr__(name: str) -> Any:
    if name == "load_model":
        from finetune.models.loading import load_model

        return load_model
    if name == "load_finetuned":
        from finetune.models.adapters import load_finetuned

        return load_finetuned
    raise AttributeError(f"module 'finetune' has no attribute {name!r}")
