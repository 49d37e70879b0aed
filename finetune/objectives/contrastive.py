"""Base terms: ``clip`` (InfoNCE), ``siglip`` (sigmoid) and ``longclip`` (Long-CLIP's long + short loss).

They register like every other term (:func:`finetune.objectives.register_term`): ``objective.base: clip``
builds one with its options' defaults (and ``objective.label_smoothing``), ``objective.terms.clip: {...}``
with the recipe's options.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from losses import clip_loss, longclip_loss, siglip_loss

from .base import Batch, Features, ImageRequest, Term, TextRequest, scale_of
from .registry import Citation, register_term


def _smoothing(value: Any) -> str | None:
    return None if 0 <= value < 1 else f"must be in [0, 1), got {value!r}"


def _at_least_one(value: Any) -> str | None:
    return None if value >= 1 else f"must be >= 1, got {value!r}"


@dataclass
class ClipOptions:
    """``clip``: cross-entropy label smoothing (0 in CLIP and StructXLIP)."""

    label_smoothing: float = field(default=0.0, metadata={"check": _smoothing})


def _exchange(value: Any) -> str | None:
    return None if value in ("gather", "ring") else f"must be 'gather' or 'ring', got {value!r}"


@dataclass
class SiglipOptions:
    """``siglip``: the scale and bias are the model's ``logit_scale`` / ``logit_bias``; ``exchange`` is how
    texts reach the other processes (``gather``: one all-gather; ``ring``: SigLIP 3.3's chunked neighbour
    exchange, one ``(B, B)`` block at a time; same loss and gradients, see :func:`losses.siglip_loss`)."""

    exchange: str = field(default="gather", metadata={"check": _exchange})


@dataclass
class LongClipOptions:
    """``longclip``: label smoothing of both InfoNCE terms and the PCA rank of the short-caption targets
    (0.1 and 32 in Long-CLIP's training code)."""

    label_smoothing: float = field(default=0.1, metadata={"check": _smoothing})
    pca_dim: int = field(default=32, metadata={"check": _at_least_one})


def image_request(batch: Batch) -> ImageRequest:
    """The batch's colour images as an encoder request."""
    return ImageRequest(batch["image_inputs"])


class ClipTerm(Term):
    """Symmetric InfoNCE between images and captions (CLIP; StructXLIP's L_{I,T}).

    Args:
        label_smoothing: cross-entropy label smoothing (0 in CLIP and StructXLIP).
    """

    name = "clip"
    contrastive = True
    requests = frozenset({"image", "text"})

    def __init__(self, label_smoothing: float = 0.0) -> None:
        super().__init__()
        self.label_smoothing = label_smoothing

    def image_inputs(self, batch: Batch) -> dict[str, ImageRequest]:
        return {"image": image_request(batch)}

    def text_inputs(self, batch: Batch) -> dict[str, TextRequest]:
        return {"text": TextRequest(batch["input_ids"], batch["attention_mask"])}

    def loss(self, model: Any, feats: Features, *, detach_params: bool = False) -> dict[str, Tensor]:
        s = scale_of(model.logit_scale, detach_params)
        return {"clip": clip_loss(feats["image"], feats["text"], s, label_smoothing=self.label_smoothing)}


class SiglipTerm(Term):
    """Pairwise sigmoid loss (SigLIP): ``-sum log sigmoid(y (s cos + b)) / B``."""

    name = "siglip"
    contrastive = True
    requests = frozenset({"image", "text"})
    uses_logit_bias = True

    def __init__(self, exchange: str = "gather") -> None:
        super().__init__()
        self.exchange = exchange

    def image_inputs(self, batch: Batch) -> dict[str, ImageRequest]:
        return {"image": image_request(batch)}

    def text_inputs(self, batch: Batch) -> dict[str, TextRequest]:
        return {"text": TextRequest(batch["input_ids"], batch["attention_mask"])}

    def loss(self, model: Any, feats: Features, *, detach_params: bool = False) -> dict[str, Tensor]:
        if model.logit_bias is None:
            raise ValueError(
                "objective.base: siglip needs a model with a logit bias (SigLIP/SigLIP2); "
                "use objective.base: clip for CLIP models"
            )
        s = scale_of(model.logit_scale, detach_params)
        b = model.logit_bias.detach() if detach_params else model.logit_bias
        return {"siglip": siglip_loss(feats["image"], feats["text"], s, b, exchange=self.exchange)}


class LongClipTerm(Term):
    """Long-CLIP's loss (Long-CLIP public training code): InfoNCE on the long caption plus InfoNCE of the
    first sentence against the PCA-32 reconstruction of the image batch, both with label smoothing 0.1."""

    name = "longclip"
    contrastive = True
    needs = frozenset({"short_caption"})
    produces = frozenset({"short_caption", "short_input_ids", "short_attention_mask"})
    requests = frozenset({"image", "text", "short_text"})

    def __init__(self, label_smoothing: float = 0.1, pca_dim: int = 32) -> None:
        super().__init__()
        self.label_smoothing = label_smoothing
        self.pca_dim = pca_dim

    def prepare(self, example: dict[str, Any]) -> dict[str, Any]:
        from finetune.data.text import first_sentence

        return {"short_caption": first_sentence(example["caption"])}

    def collate(self, examples: list[dict[str, Any]], model: Any) -> dict[str, Any]:
        tok = model.tokenize([e["short_caption"] for e in examples])
        return {"short_input_ids": tok.input_ids, "short_attention_mask": tok.attention_mask}

    def image_inputs(self, batch: Batch) -> dict[str, ImageRequest]:
        return {"image": image_request(batch)}

    def text_inputs(self, batch: Batch) -> dict[str, TextRequest]:
        return {
            "text": TextRequest(batch["input_ids"], batch["attention_mask"]),
            "short_text": TextRequest(batch["short_input_ids"], batch["short_attention_mask"], short=True),
        }

    def shape_scan(self, dataset: Any, model: Any) -> Any:
        """The first sentence of each training caption (the short texts, whose lengths plan the short passes)."""
        from finetune.data.text import first_sentence

        from .shapes import SHORT, ShapeScan, dataset_columns

        cols = dataset_columns(dataset, ["caption"])
        return None if cols is None else ShapeScan(texts={SHORT: [[first_sentence(c or "")] for c in cols["caption"]]})

    def loss(self, model: Any, feats: Features, *, detach_params: bool = False) -> dict[str, Tensor]:
        s = scale_of(model.logit_scale, detach_params)
        value = longclip_loss(
            feats["image"], feats["text"], feats["short_text"], s,
            pca_dim=self.pca_dim, label_smoothing=self.label_smoothing,
        )
        return {"longclip": value}


BASE_TERMS: dict[str, type[Term]] = {"clip": ClipTerm, "siglip": SiglipTerm, "longclip": LongClipTerm}


@register_term("clip", ClipOptions, citation=Citation(
    "Radford et al., Learning Transferable Visual Models From Natural Language Supervision (ICML 2021)",
    "https://arxiv.org/abs/2103.00020"))
def build_clip(options: ClipOptions) -> tuple[ClipTerm, float]:
    """``clip``: :class:`ClipTerm` with weight 1."""
    return ClipTerm(label_smoothing=options.label_smoothing), 1.0


@register_term("siglip", SiglipOptions, citation=Citation(
    "Zhai et al., Sigmoid Loss for Language Image Pre-Training (ICCV 2023)", "https://arxiv.org/abs/2303.15343"))
def build_siglip(options: SiglipOptions) -> tuple[SiglipTerm, float]:
    """``siglip``: :class:`SiglipTerm` with weight 1."""
    return SiglipTerm(exchange=options.exchange), 1.0


@register_term("longclip", LongClipOptions, citation=Citation(
    "Zhang et al., Long-CLIP: Unlocking the Long-Text Capability of CLIP (ECCV 2024)",
    "https://arxiv.org/abs/2403.15378", tag="long-clip"))
def build_longclip(options: LongClipOptions) -> tuple[LongClipTerm, float]:
    """``longclip``: :class:`LongClipTerm` with weight 1."""
    return LongClipTerm(label_smoothing=options.label_smoothing, pca_dim=options.pca_dim), 1.0
