"""The model a run trains: loaded from ``model.name_or_path`` or from the ``final/`` of the run ``model.init_from``
names (:func:`load_start_model`), then made ready for the objective (:func:`prepare_for_training`: adapter,
gradient checkpointing, the terms' heads, on the device)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from finetune.config import Recipe, RecipeError
from finetune.config.model_options import family_loader_options
from finetune.models.adapters import apply_adapter, enable_gradient_checkpointing
from finetune.models.families import recipe_family
from finetune.models.finetuned import TextLengthError, apply_text_length, load_finetuned, load_model, read_info
from finetune.objectives import Objective
from finetune.training.upstream import Prerequisite

log = logging.getLogger("xlipkit")

__all__ = ["load_start_model", "parameter_counts", "prepare_for_training"]


def load_start_model(m: Any, init: Prerequisite | None) -> Any:
    """The model a run starts from: ``model.name_or_path`` as loaded, or the ``final/`` of the run that
    ``model.init_from`` names (an adapter folded into its base), stretched to ``model.max_text_len``.

    Args:
        m: the recipe's ``model`` section.
        init: the ``model.init_from`` run (:class:`~finetune.training.upstream.Prerequisite`), or None.
    Raises:
        RecipeError: ``model.max_text_len`` below what the model has.
    """
    try:
        return _load_start_model(m, init)
    except TextLengthError as exc:  # a recipe value the model cannot take, not a broken model
        raise RecipeError(f"model.max_text_len: {exc}", key="model.max_text_len") from None


def _load_start_model(m: Any, init: Prerequisite | None) -> Any:
    kps = dict(vars(m.kps)) if m.kps is not None else None
    if init is None:
        return load_model(m.name_or_path, family=recipe_family(m), max_text_len=m.max_text_len, dtype=m.dtype,
                          trust_remote_code=m.trust_remote_code, kps=kps, family_options=family_loader_options(m))
    log.info("model.init_from: starting from %s (%s, %s); model.name_or_path is not loaded", init.final, init.ref,
             init.status)
    if read_info(init.final)["kind"] == "full":
        return load_model(str(init.final), max_text_len=m.max_text_len, dtype=m.dtype, kps=kps).train()
    model = load_finetuned(init.final, merge=True)
    if m.max_text_len is not None:
        apply_text_length(model, int(m.max_text_len), kps)
    if m.dtype is not None:
        model.to(getattr(torch, m.dtype))
    return model.train()


def prepare_for_training(model: Any, recipe: Recipe, objective: Objective, device: torch.device) -> Any:
    """``model`` ready for ``objective``: the recipe's adapter (full, LoRA, DoRA), gradient checkpointing, the
    terms told ``data.on_error``, a logit bias no term reads frozen (an unused parameter breaks DDP, open_clip
    #1076), on ``device``, with the heads the terms add (GRM's) created before the optimiser sees the parameters.
    Returns the model (adapter applied)."""
    model = apply_adapter(model, recipe.adapter)
    if recipe.model.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    for term in objective.all_terms:  # terms that drop one sample's unusable field (FAST-GOAL's boxes) follow it
        if hasattr(term, "on_error"):
            term.on_error = recipe.data.on_error
    if model.logit_bias is not None and not any(t.uses_logit_bias for t in objective.all_terms):
        model.logit_bias.requires_grad_(False)  # InfoNCE on a SigLIP model leaves the bias alone
    model.to(device)
    objective.prepare_model(model)
    return model


def parameter_counts(model: Any, objective: Objective) -> tuple[int, int]:
    """``(trainable, total)`` parameters of what trains: the model and the objective's own parameters
    (StructXLIP's structure temperature, GRM's head), so that trainable never exceeds total."""
    params = list({id(p): p for p in [*model.parameters(), *objective.parameters()]}.values())  # a head in both
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)
