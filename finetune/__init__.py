"""xlipkit's toolkit: models, data, objectives, training, evaluation and hub.

``from finetune import load_model, load_finetuned, register_model_family,
register_inference_module`` (imported lazily, so that ``import finetune``
stays cheap)."""

from __future__ import annotations

from typing import Any

__all__ = ["load_model", "load_finetuned", "register_model_family", "register_inference_module"]


def __getattr__(name: str) -> Any:
    if name == "load_model":
        from finetune.models.finetuned import load_model

        return load_model
    if name == "load_finetuned":
        from finetune.models.finetuned import load_finetuned

        return load_finetuned
    if name == "register_model_family":
        from finetune.models.families import register_model_family

        return register_model_family
    if name == "register_inference_module":
        from finetune.models.inference_modules import register_inference_module

        return register_inference_module
    raise AttributeError(f"module 'finetune' has no attribute {name!r}")
