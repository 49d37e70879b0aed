"""One encoder interface over every backend (DESIGN 4, "DualEncoder").

A :class:`DualEncoder` wraps a backend model (transformers ``CLIPModel`` / ``SiglipModel`` /
``Siglip2Model`` or an open_clip model) and exposes the two towers with the same names and shapes,
so that losses, objectives and the training loop never look at the backend.

Conventions:
- ``embeds`` are the model's projected global embeddings, *raw* (not L2-normalised).
- ``states`` are last-layer token states *before* the tower's final norm, with prefix tokens (CLS,
  registers) removed for images; ``project_*_states`` applies the model's own final norm and
  projection, so that projecting the pooled token reproduces ``embeds``.
- ``logit_scale`` is the *log* of the multiplier (CLIP convention); ``logit_bias`` is raw.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from finetune.models.core.tokens import TokenizedText  # re-exported: `from finetune.models import TokenizedText`


@dataclass
class ImageFeatures:
    """Output of :meth:`DualEncoder.encode_image`.

    Attributes:
        embeds: ``(B, D)`` projected global embedding.
        states: ``(B, N, W)`` last-layer patch states before the final norm, prefix tokens removed;
            ``None`` unless asked for; ``(n, N, W)``, the first n images', when ``encode_image`` was
            given ``states_rows=n``.
        grid: patch grid ``(rows, cols)`` with ``rows * cols == N``. For SigLIP2 NaFlex batches whose
            images have different grids it is ``(0, 0)``: read ``spatial_shapes`` instead.
        pooled_state: ``(B, W)`` the state (before the final norm) whose projection is ``embeds``
            (the CLS token of CLIP towers); ``None`` unless ``states`` were asked for, and ``None``
            for attention-pooled towers (SigLIP's MAP head pools all patches).
        patch_mask: ``(B, N)`` 1 for real patches, 0 for NaFlex padding; ``None`` for fixed grids.
        spatial_shapes: ``(B, 2)`` NaFlex per-image patch grid ``(rows, cols)``; ``None`` otherwise.
    """

    embeds: Tensor
    states: Tensor | None
    grid: tuple[int, int]
    pooled_state: Tensor | None = None
    patch_mask: Tensor | None = None
    spatial_shapes: Tensor | None = None


def first_state_rows(feats: ImageFeatures, n: int | None) -> ImageFeatures:
    """``feats`` with ``states`` cut to the first ``n`` images (``n`` None: unchanged); for backends that
    compute every image's states anyway."""
    if n is None or feats.states is None:
        return feats
    return replace(feats, states=feats.states[:n])


@dataclass
class TextFeatures:
    """Output of :meth:`DualEncoder.encode_text`.

    Attributes:
        embeds: ``(B, D)`` projected global embedding.
        states: ``(B, L, W)`` last-layer token states before the final norm; ``None`` unless asked.
        attention_mask: ``(B, L)`` 1 for real tokens, 0 for padding.
        pool_positions: ``(B,)`` index of the token whose state is projected into ``embeds`` (the
            EOS token for CLIP, the last position for SigLIP); filled when ``states`` are asked for.
    """

    embeds: Tensor
    states: Tensor | None
    attention_mask: Tensor
    pool_positions: Tensor | None = None


CAPABILITIES = ("states", "kps", "patch_geometry", "gradient_checkpointing")


class MissingCapabilityError(ValueError):
    """A model lacks an optional :class:`DualEncoder` capability that was asked of it (the message
    names the capability, the model and what needed it)."""


class DualEncoder(nn.Module, abc.ABC):
    """Base class of the model families: ``HFDualEncoder``, ``OpenCLIPDualEncoder`` and those that
    :func:`finetune.models.register_model_family` adds.

    Subclasses set ``backend`` (the model family that loads them: ``"hf"``, ``"open_clip"``, ...),
    ``family`` (the contrastive family: ``"clip"``, ``"siglip"`` or ``"siglip2"``), ``model`` (the
    wrapped module), ``tokenizer``, ``image_processor``, ``max_text_len``, ``patch_size``,
    ``image_size`` and ``name_or_path``.

    The core every model implements: :meth:`tokenize`, :meth:`preprocess_images`,
    :meth:`encode_image`, :meth:`encode_text`, :attr:`logit_scale` (and :attr:`logit_bias`) and
    :meth:`save_pretrained`. Optional capabilities (:data:`CAPABILITIES`, see
    :meth:`capabilities`), which a model has only when it says so:

    - ``states``: ``encode_*(states=True)`` and ``project_*_states`` (class attribute
      ``supports_states = True``);
    - ``kps``: a text position table that Long-CLIP KPS stretches (:meth:`position_embedding`
      returns it, :meth:`resize_text_positions` replaces it);
    - ``patch_geometry``: :meth:`image_transform_params` maps image boxes to patches;
    - ``gradient_checkpointing``: :meth:`set_gradient_checkpointing`.

    Code that needs one calls :meth:`require`, which raises :class:`MissingCapabilityError`
    naming it. ``inference_modules`` (an ``nn.ModuleDict``) holds modules the model needs at
    inference beyond its towers (a term's head), saved and loaded with the model
    (:mod:`finetune.models.inference_modules`).

    ``truncation_stats`` counts the captions :meth:`tokenize` has seen and how many of them did
    not fit (``{"captions": int, "truncated": int}``), so that a run can report it.
    """

    backend: str = ""
    family: str = "clip"
    name_or_path: str = ""
    #: the ``states`` capability: ``encode_*(states=True)`` and ``project_*_states`` work
    supports_states: bool = False

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.tokenizer: Any = None
        self.image_processor: Any = None
        self.max_text_len: int = 77
        self.patch_size: int = 16
        self.image_size: int = 224
        #: the original text length of the pretrained model, before any KPS stretch
        self.base_text_len: int = 77
        #: KPS settings once applied (``{"length", "keep", "ratio", "freeze_kept"}``), else None
        self.kps: dict[str, Any] | None = None
        #: the adapter settings once :func:`finetune.models.adapters.apply_adapter` ran, else None
        self.adapter: Any = None
        self.truncation_stats: dict[str, int] = {"captions": 0, "truncated": 0}
        #: modules the model needs at inference beyond its towers, saved with it
        self.inference_modules = nn.ModuleDict()

    # -- capabilities -----------------------------------------------------------------------------
    def capabilities(self) -> frozenset[str]:
        """The optional capabilities this model has (a subset of :data:`CAPABILITIES`)."""
        found = set()
        if self.supports_states:
            found.add("states")
        if self.position_embedding() is not None:
            found.add("kps")
        if self.image_transform_params() is not None:
            found.add("patch_geometry")
        if type(self).set_gradient_checkpointing is not DualEncoder.set_gradient_checkpointing:
            found.add("gradient_checkpointing")
        return frozenset(found)

    def require(self, capability: str, purpose: str) -> None:
        """Raise :class:`MissingCapabilityError` unless the model has ``capability``.

        Args:
            capability: one of :data:`CAPABILITIES`.
            purpose: what needs it, for the message (``"Long-CLIP KPS (apply_kps)"``).
        """
        if capability not in CAPABILITIES:
            raise ValueError(f"unknown capability {capability!r}; known: {CAPABILITIES}")
        if capability not in self.capabilities():
            have = ", ".join(sorted(self.capabilities())) or "none"
            raise MissingCapabilityError(
                f"{purpose} needs the {capability!r} capability, which model {self.name_or_path!r} "
                f"({type(self).__name__}, model family {self.backend!r}) does not have (it has: {have}); "
                f"use a model that has it or leave out what needs it")

    # -- towers ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def encode_image(
        self, pixel_values: Tensor, *, states: bool = False, states_rows: int | None = None, **kwargs: Any
    ) -> ImageFeatures:
        """Encode images ``(B, 3, H, W)`` (NaFlex: ``(B, N, 3·p·p)`` patches plus the
        ``pixel_attention_mask`` and ``spatial_shapes`` keywords) into :class:`ImageFeatures`; with
        ``states``, ``states_rows`` = n asks for the patch states of the first n images only (the rest
        need only their embeddings, which a backend may compute with less work)."""

    @abc.abstractmethod
    def encode_text(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, *, states: bool = False
    ) -> TextFeatures:
        """Encode token ids ``(B, L)`` into :class:`TextFeatures`."""

    def encode_text_groups(self, groups: list[tuple[Tensor, Tensor]], *, right_padded: bool = False) -> list[Tensor]:
        """Embeddings of several groups of token ids, e.g. length buckets: ``[(ids (B_g, L_g), mask (B_g,
        L_g)), ...]`` -> ``[(B_g, D), ...]``, each equal to ``encode_text(ids, mask).embeds``. Backends may
        share work between the groups (transformers CLIP: one token-embedding lookup, so one dense
        embedding gradient instead of one per group).

        ``right_padded``: the caller knows (from the CPU, :class:`finetune.objectives.encoders.TextPlan`) that every
        mask is ones then zeros, so that a causal tower may skip the padding mask and its checks on the device."""
        return [self.encode_text(ids, mask).embeds for ids, mask in groups]

    def project_image_states(self, x: Tensor) -> Tensor:
        """Map image states ``(..., W)`` to the joint space ``(..., D)`` with the model's own head
        (``states`` capability)."""
        self.require("states", "project_image_states")
        raise NotImplementedError(f"{type(self).__name__} sets supports_states but does not implement "
                                  f"project_image_states")

    def project_text_states(self, x: Tensor) -> Tensor:
        """Map text states ``(..., W)`` to the joint space ``(..., D)`` with the model's own head
        (``states`` capability)."""
        self.require("states", "project_text_states")
        raise NotImplementedError(f"{type(self).__name__} sets supports_states but does not implement "
                                  f"project_text_states")

    def forward(
        self,
        pixel_values: Tensor,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        **image_kwargs: Any,
    ) -> tuple[Tensor, Tensor]:
        """Both towers in one call: ``(image_embeds (B, D), text_embeds (B', D))``.

        ``image_kwargs`` go to :meth:`encode_image` (NaFlex: ``pixel_attention_mask``,
        ``spatial_shapes``). Going through ``forward`` matters under DDP/FSDP: the wrapped module's
        hooks run.
        """
        return (
            self.encode_image(pixel_values, **image_kwargs).embeds,
            self.encode_text(input_ids, attention_mask).embeds,
        )

    # -- parameters the losses need ---------------------------------------------------------------
    @property
    @abc.abstractmethod
    def logit_scale(self) -> nn.Parameter:
        """The log of the logit multiplier (a scalar parameter)."""

    @property
    def logit_bias(self) -> nn.Parameter | None:
        """The SigLIP logit bias (raw), or ``None`` for the CLIP family."""
        return None

    # -- text -------------------------------------------------------------------------------------
    @abc.abstractmethod
    def tokenize(self, texts: list[str], *, max_length: int | None = None) -> TokenizedText:
        """Tokenise captions, truncating to ``max_length`` (default ``max_text_len``) with the end
        token kept, and report which captions were truncated."""

    def sentence_spans(self, captions: list[str]) -> list[list[tuple[int, int] | None]]:
        """Where each sentence of each caption lies in the token ids of ``tokenize(captions)``.

        Sentences are those of :func:`finetune.data.text.split_sentences`. A span is a half-open
        range ``(start, end)`` of positions in a row of ``tokenize(captions).input_ids`` ``(B, L)``
        (padding included, so that ``states[b, start:end]`` of :meth:`encode_text` ``(B, L, W)``
        are the sentence's token states, e.g. for FAST-GOAL's TSL): a start token is position 0,
        so a caption's first word is at 1 for CLIP (0 for tokenizers without one, as SigLIP's). A
        range holds the tokens of the sentence's own characters, its final punctuation included
        unless the tokenizer glues that to the next character (open_clip's BPE on "dog.</s>");
        text between sentences (spaces, ``</s>``) and special tokens belong to no sentence.

        Transformers fast tokenizers give the ranges through their ``offset_mapping``; other
        tokenizers (open_clip's BPE, tokenizers that clean the text first) by tokenising sentence
        by sentence and checking that the pieces concatenate to the caption's ids. Calls
        :meth:`tokenize` without counting in ``truncation_stats``.

        Args:
            captions: ``B`` captions.
        Returns:
            per caption, one entry per sentence: ``(start, end)``, or ``None`` where truncation
            to ``max_text_len`` cut (part of) the sentence, or where the sentence has no token
            of its own.
        """
        from finetune.models.core.spans import spans_by_pieces

        if isinstance(captions, str):
            raise TypeError("captions must be a list of strings, not one string: wrap it as [caption]")
        return spans_by_pieces(self, list(captions))

    def position_embedding(self) -> nn.Parameter | None:
        """The text tower's positional table ``(max_text_len, W)`` (the tensor KPS stretches), or
        None for a model without one (no ``kps`` capability)."""
        return None

    def resize_text_positions(self, table: Tensor) -> None:
        """Replace the text positional table by ``table`` ``(L', W)`` and update everything that
        knows the text length (position ids, causal mask, config, tokenizer ``model_max_length``,
        ``max_text_len``). Used by :func:`finetune.models.longclip.apply_kps` (``kps``
        capability)."""
        self.require("kps", "resize_text_positions")
        raise NotImplementedError(f"{type(self).__name__} has a position table but does not implement "
                                  f"resize_text_positions")

    def _count_truncation(self, truncated: Tensor) -> None:
        self.truncation_stats["captions"] += int(truncated.numel())
        self.truncation_stats["truncated"] += int(truncated.sum())

    # -- images -----------------------------------------------------------------------------------
    @abc.abstractmethod
    def preprocess_images(self, images: list[Any]) -> dict[str, Tensor]:
        """Turn PIL images into the keyword inputs of :meth:`encode_image` with the backend's own
        image processor: ``pixel_values`` ``(B, 3, H, W)``, or for NaFlex ``pixel_values``
        ``(B, N, 3·p·p)``, ``pixel_attention_mask`` ``(B, N)`` and ``spatial_shapes`` ``(B, 2)``."""

    def image_transform_params(self) -> dict[str, Any] | None:
        """The exact geometry and normalisation of :meth:`preprocess_images`, so that a box in the
        original image can be mapped to patch coordinates.

        Keys: ``mode`` (``"shortest_center_crop"``: resize the shortest side to ``size`` then
        centre-crop ``crop`` ``(h, w)``; ``"squash"``: resize to ``size`` ``(h, w)``;
        ``"longest_pad"``: resize the longest side to ``size`` then pad to a square;
        ``"naflex"``: aspect-preserving resize to at most ``max_num_patches`` patches),
        ``size``, ``crop``, ``resample`` (e.g. ``"bicubic"``), ``mean``, ``std``, ``patch_size``,
        ``max_num_patches`` (NaFlex only), ``crop_offset`` (optional: ``"floor"``, the default, when
        the centre crop cuts ``excess // 2`` pixels first, as transformers does; ``"round"`` for
        torchvision's ``round(excess / 2)``).

        None for a model without the ``patch_geometry`` capability (the default).
        """
        return None

    # -- training helpers -------------------------------------------------------------------------
    def set_gradient_checkpointing(self, enable: bool = True) -> None:
        """Turn activation checkpointing of both towers on or off (non-reentrant, so that frozen
        inputs do not stop gradients from reaching adapter weights); ``gradient_checkpointing``
        capability."""
        if enable:
            self.require("gradient_checkpointing", "model.gradient_checkpointing")

    def adapter_preset(self, *, include_mlp: bool = True) -> str | None:
        """A full-match regex of the module names that LoRA / DoRA adapt under ``adapter.targets:
        preset`` for a model family of its own (``hf`` and ``open_clip`` have theirs in
        :mod:`finetune.models.adapters`); None: no preset, the recipe names the targets."""
        return None

    # -- description ------------------------------------------------------------------------------
    def config_dict(self) -> dict[str, Any]:
        """A JSON-serialisable description: backend, family, base model, text lengths, KPS."""
        return {
            "backend": self.backend,
            "family": self.family,
            "name_or_path": self.name_or_path,
            "base_text_len": self.base_text_len,
            "max_text_len": self.max_text_len,
            "kps": dict(self.kps) if self.kps else None,
            "image_size": self.image_size,
            "patch_size": self.patch_size,
        }

    def trainable_parameter_names(self) -> list[str]:
        """Names of the parameters with ``requires_grad``."""
        return [n for n, p in self.named_parameters() if p.requires_grad]

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @abc.abstractmethod
    def save_pretrained(self, path: str) -> None:
        """Write the model in its backend's native format (plus tokenizer and processor)."""
