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
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn


@dataclass
class ImageFeatures:
    """Output of :meth:`DualEncoder.encode_image`.

    Attributes:
        embeds: ``(B, D)`` projected global embedding.
        states: ``(B, N, W)`` last-layer patch states before the final norm, prefix tokens removed;
            ``None`` unless asked for.
        grid: patch grid ``(rows, cols)`` with ``rows * cols == N``.
    """

    embeds: Tensor
    states: Tensor | None
    grid: tuple[int, int]


@dataclass
class TextFeatures:
    """Output of :meth:`DualEncoder.encode_text`.

    Attributes:
        embeds: ``(B, D)`` projected global embedding.
        states: ``(B, L, W)`` last-layer token states before the final norm; ``None`` unless asked.
        attention_mask: ``(B, L)`` 1 for real tokens, 0 for padding.
    """

    embeds: Tensor
    states: Tensor | None
    attention_mask: Tensor


@dataclass
class TokenizedText:
    """Token ids of a batch of captions, padded to a common length.

    Attributes:
        input_ids: ``(B, L)`` token ids.
        attention_mask: ``(B, L)`` 1 for real tokens.
        truncated: ``(B,)`` bool, True where the caption did not fit and was cut (end token kept).
    """

    input_ids: Tensor
    attention_mask: Tensor
    truncated: Tensor

    def to(self, device: torch.device | str) -> "TokenizedText":
        return TokenizedText(
            self.input_ids.to(device), self.attention_mask.to(device), self.truncated.to(device)
        )


class DualEncoder(nn.Module, abc.ABC):
    """Base class of the backends: ``HFDualEncoder`` and ``OpenCLIPDualEncoder``.

    Subclasses set ``backend`` (``"hf"`` or ``"open_clip"``), ``family`` (``"clip"``, ``"siglip"``
    or ``"siglip2"``), ``model`` (the wrapped backend module), ``tokenizer``, ``image_processor``,
    ``max_text_len``, ``patch_size``, ``image_size`` and ``name_or_path``, and implement the
    abstract methods below.
    """

    backend: str = ""
    family: str = "clip"
    name_or_path: str = ""

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

    # -- towers ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def encode_image(self, pixel_values: Tensor, *, states: bool = False, **kwargs: Any) -> ImageFeatures:
        """Encode images ``(B, 3, H, W)`` into :class:`ImageFeatures`."""

    @abc.abstractmethod
    def encode_text(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, *, states: bool = False
    ) -> TextFeatures:
        """Encode token ids ``(B, L)`` into :class:`TextFeatures`."""

    @abc.abstractmethod
    def project_image_states(self, x: Tensor) -> Tensor:
        """Map image states ``(..., W)`` to the joint space ``(..., D)`` with the model's own head."""

    @abc.abstractmethod
    def project_text_states(self, x: Tensor) -> Tensor:
        """Map text states ``(..., W)`` to the joint space ``(..., D)`` with the model's own head."""

    def forward(
        self, pixel_values: Tensor, input_ids: Tensor, attention_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Both towers in one call: ``(image_embeds (B, D), text_embeds (B', D))``.

        Going through ``forward`` matters under DDP/FSDP: the wrapped module's hooks run.
        """
        return (
            self.encode_image(pixel_values).embeds,
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

    @abc.abstractmethod
    def position_embedding(self) -> nn.Parameter:
        """The text tower's positional table ``(max_text_len, W)`` (the tensor KPS stretches)."""

    # -- state dict helpers -----------------------------------------------------------------------
    def trainable_parameter_names(self) -> list[str]:
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
