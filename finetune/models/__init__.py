"""The model layer (DESIGN 2 and 4): one :class:`DualEncoder` over transformers and open_clip CLIP /
SigLIP / SigLIP2 models and the model families registered with ``register_model_family``, modules
saved for inference (``register_inference_module``), Long-CLIP KPS, full / LoRA / DoRA adapters,
and the registry of named configs. Heavy modules load lazily, on first use of a name.

Layout: ``core/`` (``encoder``: DualEncoder; ``tokens``: TokenizedText; ``spans``), ``backends/``
(``hf``, ``openclip``, ``pooled_tower``, ``activations``), ``families/`` (one module per model
family with its named configs: ``hf``, ``open_clip``, ``vision_text``, ``flair``, ``fcast``),
``longclip`` (KPS), ``adapters`` (full / LoRA / DoRA), ``finetuned`` (``load_model``,
``save_finetuned`` / ``load_finetuned``), ``registry`` (named-config lookup)."""

from __future__ import annotations

import importlib
from typing import Any

from finetune.models.core.encoder import (
    CAPABILITIES,
    DualEncoder,
    ImageFeatures,
    MissingCapabilityError,
    TextFeatures,
    TokenizedText,
)
from finetune.models.weight_decay import no_weight_decay_names, param_groups

_LAZY = {
    "load_model": "finetune.models.finetuned",
    "apply_text_length": "finetune.models.finetuned",
    "load_finetuned": "finetune.models.finetuned",
    "save_finetuned": "finetune.models.finetuned",
    "apply_adapter": "finetune.models.adapters",
    "merge_adapter": "finetune.models.adapters",
    "enable_gradient_checkpointing": "finetune.models.adapters",
    "AdapterConfig": "finetune.models.adapters",
    "stretch_positions": "finetune.models.longclip",
    "apply_kps": "finetune.models.longclip",
    "build_model": "finetune.models.registry",
    "save_tiny": "finetune.models.registry",
    "registry_names": "finetune.models.registry",
    "TINY_NAMES": "finetune.models.registry",
    "HFDualEncoder": "finetune.models.backends.hf",
    "OpenCLIPDualEncoder": "finetune.models.backends.openclip",
    "FlairDualEncoder": "finetune.models.families.flair",
    "load_flair_checkpoint": "finetune.models.families.flair",
    "register_model_family": "finetune.models.families",
    "unregister_model_family": "finetune.models.families",
    "model_family_names": "finetune.models.families",
    "get_model_family": "finetune.models.families",
    "detect_family": "finetune.models.families",
    "ModelFamily": "finetune.models.families",
    "register_inference_module": "finetune.models.inference_modules",
    "inference_module_names": "finetune.models.inference_modules",
}

__all__ = ["CAPABILITIES", "DualEncoder", "ImageFeatures", "MissingCapabilityError", "TextFeatures",
           "TokenizedText", "no_weight_decay_names", "param_groups", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'finetune.models' has no attribute {name!r}")
