"""Full fine-tuning, LoRA and DoRA through peft; target presets per backend; save, load, merge.

LoRA (Hu et al., 2021) adds ``B·A`` (rank ``r``, scaled by ``alpha / r``) to frozen linear layers;
DoRA (Liu et al., 2024) also learns each column's magnitude: peft ``LoraConfig(use_dora=True)``.
Presets (DESIGN 4) name the attention and MLP linears:

- transformers CLIP / SigLIP / SigLIP2: ``self_attn.{q,k,v,out}_proj`` and ``mlp.fc1 / fc2``
  (SigLIP's pooling-head MLP included; its ``nn.MultiheadAttention`` is not, as peft cannot adapt
  its ``out_proj`` separately).
- open_clip: the blocks' ``nn.MultiheadAttention`` (peft adapts in_proj and out_proj) and
  ``mlp.c_fc / c_proj``; timm towers: ``attn.qkv / proj`` and ``mlp.fc1 / fc2``. peft has no DoRA
  for ``nn.MultiheadAttention``, so DoRA on open_clip's own transformer blocks adapts their MLPs
  only (a warning says so).

The stretched text positions and ``logit_scale`` / ``logit_bias`` train alongside the adapter as
plain trainable parameters (``train_extra``) and are saved next to it.

Saving and loading a fine-tuned model (``save_finetuned`` / ``load_finetuned``, the adapter folder
with ``xlipkit.json``) is :mod:`finetune.models.finetuned`; this module holds what they use from peft
(:func:`base_signature`, :func:`peft_model_of`, :func:`extra_parameter_names`) and imports neither it
nor ``load_model``.
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

# the one adapter settings class: the recipe's `adapter` section (validated by the recipe schema;
# built in code, a bad value raises a RecipeError naming `adapter.<key>`)
from finetune.config import AdapterConfig
from finetune.models.core.encoder import DualEncoder

log = logging.getLogger(__name__)

ADAPTER_TYPES = ("full", "lora", "dora")
EXTRA_NAME = "xlipkit_extra.safetensors"
#: symbolic ``train_extra`` entries
EXTRA_SYMBOLS = ("positions", "logit_scale", "logit_bias")

_HF_ATTN = r".*\.self_attn\.(?:q_proj|k_proj|v_proj|out_proj)"
_HF_MLP = r".*\.mlp\.(?:fc1|fc2)"
_OC_ATTN = r"(?:.*\.)?resblocks\.\d+\.attn"
_OC_MLP = r"(?:.*\.)?resblocks\.\d+\.mlp\.(?:c_fc|c_proj)"
_TIMM_ATTN = r".*\.blocks\.\d+\.attn\.(?:qkv|proj)"
_TIMM_MLP = r".*\.trunk\.(?:blocks\.\d+|attn_pool)\.mlp\.(?:fc1|fc2)"


# -- presets and parameter selection -------------------------------------------------------------------
def target_modules(model: DualEncoder, cfg: AdapterConfig) -> str | list[str]:
    """peft ``target_modules`` for ``model`` under ``cfg``: a full-match regex for the preset,
    else the list of names. Raises ValueError when nothing would be adapted."""
    extra = list(cfg.extra_targets)
    if cfg.targets != "preset":
        names = list(cfg.targets) + extra
        if not names:
            raise ValueError("adapter.targets is an empty list and adapter.extra_targets is empty: nothing to adapt")
        return names
    dora = cfg.type == "dora"
    preset = model.adapter_preset(include_mlp=cfg.include_mlp)
    if preset is not None:
        return "(?:" + "|".join([preset] + [r"(?:.*\.)?" + re.escape(name) for name in extra]) + ")"
    kind = _builtin_kind(model)
    if kind is None:
        raise ValueError(f"model family {model.backend!r} ({type(model).__name__}) has no adapter preset: give "
                         f"adapter.targets as a list of module names of {model.name_or_path!r}")
    if kind == "hf":
        patterns = [_HF_ATTN] + ([_HF_MLP] if cfg.include_mlp else [])
    else:
        patterns = [_TIMM_ATTN] + ([_TIMM_MLP] if cfg.include_mlp else [])
        if dora:
            log.warning("peft has no DoRA for nn.MultiheadAttention: the attention of open_clip's own transformer "
                        "blocks gets no adapter, their MLP linears do")
        else:
            patterns.append(_OC_ATTN)
        if cfg.include_mlp:
            patterns.append(_OC_MLP)
    patterns += [r"(?:.*\.)?" + re.escape(name) for name in extra]
    timm_vision = hasattr(model.model.visual, "trunk") if kind == "open_clip" else False
    if dora and kind == "open_clip" and not cfg.include_mlp and not extra and not timm_vision:
        raise ValueError("DoRA on open_clip without MLP targets adapts nothing (peft has no DoRA for "
                         "nn.MultiheadAttention): set adapter.include_mlp: true or use lora")
    return "(?:" + "|".join(patterns) + ")"


def _builtin_kind(model: DualEncoder) -> str | None:
    """``"hf"`` / ``"open_clip"`` when ``model`` is (a subclass of) the transformers / open_clip
    DualEncoder, so that a family built on them keeps their presets; else None."""
    for cls in type(model).__mro__:
        if (cls.__module__, cls.__name__) == ("finetune.models.backends.hf", "HFDualEncoder"):
            return "hf"
        if (cls.__module__, cls.__name__) == ("finetune.models.backends.openclip", "OpenCLIPDualEncoder"):
            return "open_clip"
    return None


def _param_names(module: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in module.named_parameters()}


def extra_parameter_names(model: DualEncoder, train_extra: list[str]) -> list[str]:
    """Resolve ``train_extra`` into names of ``model.model``'s parameters (see
    :class:`AdapterConfig`). ``"positions"`` resolves only when KPS stretched the table, and
    ``"logit_bias"`` only for models that have one.

    Raises:
        ValueError: a pattern that matches no parameter.
    """
    ids = _param_names(model.model)
    names: list[str] = []
    for entry in train_extra:
        if entry == "positions":
            if model.kps is not None:
                names.append(ids[id(model.position_embedding())])
        elif entry == "logit_scale":
            names.append(ids[id(model.logit_scale)])
        elif entry == "logit_bias":
            if model.logit_bias is not None:
                names.append(ids[id(model.logit_bias)])
        else:
            hits = [n for n in ids.values() if fnmatch.fnmatchcase(n, entry)]
            if not hits:
                sample = ", ".join(list(ids.values())[:5])
                raise ValueError(f"adapter.train_extra entry {entry!r} matches no parameter of {model.name_or_path!r} "
                                 f"(names look like: {sample}, ...); symbolic entries: {EXTRA_SYMBOLS}")
            names.extend(hits)
    return list(dict.fromkeys(names))


def base_signature(model: DualEncoder) -> dict[str, Any]:
    """A fingerprint of the base architecture: backend, family, original text length and a hash of
    every base parameter's name and shape (LoRA weights and the text positional table left out,
    peft's ``base_layer`` wrappers unwrapped). Two models with the same signature accept the same
    adapter."""
    table = model.position_embedding()
    pos = id(table) if table is not None else None
    items = []
    for name, p in model.model.named_parameters():
        if "lora_" in name or id(p) == pos:
            continue
        items.append(f"{name.replace('.base_layer', '')}:{tuple(p.shape)}")
    digest = hashlib.sha256("\n".join(sorted(items)).encode()).hexdigest()[:16]
    return {"backend": model.backend, "family": model.family, "base_text_len": model.base_text_len,
            "parameters": digest}


def peft_model_of(model: DualEncoder) -> Any:
    """The peft ``PeftModel`` wrapping ``model.model``, or None without a LoRA/DoRA adapter."""
    return model.__dict__.get("_peft")


@contextmanager
def _quiet_peft() -> Iterator[None]:
    # peft reads transformers' deprecated `is_gradient_checkpointing` when it wraps a model
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def _attach_peft(model: DualEncoder, peft_model: Any) -> None:
    # kept out of nn.Module registration: the PeftModel wraps the same modules as model.model
    object.__setattr__(model, "_peft", peft_model)


# -- apply / save / load / merge -----------------------------------------------------------------------
def apply_adapter(model: DualEncoder, cfg: AdapterConfig | dict[str, Any]) -> DualEncoder:
    """Prepare ``model`` for training under ``cfg``, in place.

    ``full``: every parameter trains. ``lora`` / ``dora``: peft injects adapters into the target
    layers (``model.model`` stays the backend model, now holding them; the ``PeftModel`` is
    :func:`peft_model_of`), freezes everything else, and the ``train_extra`` parameters are made
    trainable again.

    Returns:
        ``model``, still a :class:`DualEncoder`, with ``model.adapter = cfg``.

    Raises:
        ValueError: unknown adapter type or bad settings, targets that match no layer, a model
            that already carries an adapter.
    """
    from peft import LoraConfig, get_peft_model

    cfg = cfg if isinstance(cfg, AdapterConfig) else AdapterConfig(**cfg)
    if model.adapter is not None:
        raise ValueError(f"{model.name_or_path!r} already has an adapter ({model.adapter.type}); load the base model "
                         f"again to apply another")
    if cfg.type == "full":
        for p in model.parameters():
            p.requires_grad_(True)
        model.adapter = cfg
        return model
    extra = extra_parameter_names(model, cfg.train_extra)
    lora = LoraConfig(r=int(cfg.r), lora_alpha=cfg.alpha, lora_dropout=float(cfg.dropout),
                      target_modules=target_modules(model, cfg), use_dora=cfg.type == "dora", bias="none")
    try:
        with _quiet_peft():
            peft_model = get_peft_model(model.model, lora)
    except ValueError as e:
        raise ValueError(f"adapter targets {cfg.targets!r} + {cfg.extra_targets!r} do not fit {model.name_or_path!r} "
                         f"({model.backend}): {e}") from e
    _attach_peft(model, peft_model)
    params = dict(model.model.named_parameters())
    for name in extra:
        params[name].requires_grad_(True)
    model.adapter = cfg
    return model


def enable_gradient_checkpointing(model: DualEncoder, enable: bool = True) -> DualEncoder:
    """Non-reentrant activation checkpointing of both towers: adapter weights still get gradients
    although the layer inputs come from frozen weights (with reentrant checkpointing they would
    not, DESIGN 8)."""
    model.set_gradient_checkpointing(enable)
    return model


def merge_adapter(model: DualEncoder) -> DualEncoder:
    """Fold a LoRA/DoRA adapter into the base weights (peft ``merge_and_unload``), in place: the
    adapter layers are removed and ``model.adapter`` becomes None, so ``save_finetuned`` then
    writes a full native model.

    Raises:
        ValueError: the model has no LoRA/DoRA adapter.
    """
    peft_model = peft_model_of(model)
    if peft_model is None:
        raise ValueError(f"{model.name_or_path!r} has no LoRA/DoRA adapter to merge")
    merged = peft_model.merge_and_unload()
    model.model = merged
    _attach_peft(model, None)
    model.adapter = None
    return model
