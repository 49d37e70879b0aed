"""Base terms: ``clip`` (InfoNCE), ``siglip`` (sigmoid) and ``longclip`` (Long-CLIP's long + short loss)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from losses import clip_loss, longclip_loss, siglip_loss

from .base import Batch, Features, ImageRequest, Term, TextRequest, scale_of


def image_request(batch: Batch) -> ImageRequest:
    """The batch's colour images as an encoder request."""
    return ImageRequest(batch["image_inputs"])


class ClipTerm(Term):
    """Symmetric InfoNCE between images and captions (CLIP; StructXLIP's L_{I,T}).

    Args:
        label_smoothing: cross-entropy label smoothing (0 in CLIP and StructXLIP).
    """

    name = "clip"

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
    uses_logit_bias = True

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
        return {"siglip": siglip_loss(feats["image"], feats["text"], s, b)}


class LongClipTerm(Term):
    """Long-CLIP's loss (Long-CLIP public training code): InfoNCE on the long caption plus InfoNCE of the
    first sentence against the PCA-32 reconstruction of the image batch, both with label smoothing 0.1."""

    name = "longclip"
    needs = frozenset({"short_caption"})

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
            "short_text": TextRequest(batch["short_input_ids"], batch["short_attention_mask"]),
        }

    def loss(self, model: Any, feats: Features, *, detach_params: bool = False) -> dict[str, Tensor]:
        s = scale_of(model.logit_scale, detach_params)
        value = longclip_loss(
            feats["image"], feats["text"], feats["short_text"], s,
            pca_dim=self.pca_dim, label_smoothing=self.label_smoothing,
        )
        return {"longclip": value}


BASE_TERMS: dict[str, type[Term]] = {"clip": ClipTerm, "siglip": SiglipTerm, "longclip": LongClipTerm}
