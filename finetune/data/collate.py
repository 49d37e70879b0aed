"""Batching: images through the model's own processor (or its tensor path), captions through its own
tokenizer, plus the fields the objective's terms ask for (DESIGN 3: the data pipeline computes only what the
terms need). Everything here runs where the batch is collated, in the data-loader workers; the training loop's
planning around it (text plans, fixed shapes, micro-batches) is :mod:`finetune.objectives.planning`, above this
module."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .images import PixelNorm, TensorImages, read_image


def _to_pil(image: Any) -> Any:
    """A ``uint8 (3, H, W)`` tensor as an RGB PIL image (PIL images pass through)."""
    if not isinstance(image, Tensor):
        return image
    import PIL.Image

    return PIL.Image.fromarray(image.permute(1, 2, 0).contiguous().numpy())


__all__ = ["Collator", "EPOCH_KEY", "PIXEL_NORM", "normalize_pixels"]

#: batch key of the :class:`~finetune.data.images.PixelNorm` of ``uint8`` ``image_inputs`` (host metadata)
PIXEL_NORM = "_pixel_norm"
#: example key of superpixel labels decoded from a stream's precomputed entry (F-CAST's term), handed to the model's
#: ``preprocess_images(images, superpixels=...)`` so that the worker does not compute them
PRECOMPUTED_SUPERPIXELS = "superpixels"
#: example key of the epoch an example is drawn for (map-style data: ``finetune.training.loaders.EpochIndexed``; a
#: stream: :class:`~finetune.data.streams.loader.StreamCollate`), read by the training loop's collate function,
#: :class:`finetune.objectives.planning.PlannedCollate`, which tells the objective
EPOCH_KEY = "_epoch"


class Collator:
    """``examples -> batch`` for training and evaluation.

    The batch holds ``ids`` (list[str]), ``image_inputs`` (the keyword inputs of ``encode_image``:
    ``pixel_values (B, 3, H, W)`` and, for NaFlex, its masks), ``input_ids`` / ``attention_mask``
    ``(B, L)``, ``truncated`` ``(B,)`` bool, and the objective's fields.

    Args:
        model: the DualEncoder whose ``preprocess_images`` and ``tokenize`` are used.
        objective: an :class:`~finetune.objectives.base.Objective` (or None for plain image-caption
            batches).
        tensor_images: give ``pixel_values`` as ``uint8`` from :class:`~finetune.data.images.TensorImages`
            (the model's geometry on tensors) with their :class:`~finetune.data.images.PixelNorm` under
            :data:`PIXEL_NORM`, to be normalised on the device (:func:`normalize_pixels`, which the loop's
            :class:`~finetune.data.prefetch.DevicePrefetcher` calls); where the model's processor is not covered (NaFlex, F-CAST's superpixels) it stays in use.
            The training loop's collator sets it; the default keeps ``float`` pixels ready for ``encode_image``.
    """

    def __init__(self, model: Any, objective: Any = None, *, tensor_images: bool = False) -> None:
        self.preprocess_images = model.preprocess_images
        self.tokenize = model.tokenize
        self.objective = objective
        self._model = model
        self.images = TensorImages.for_model(model) if tensor_images else None
        self._prepares_images = bool(getattr(objective, "prepares_examples", False))

    @property
    def decode(self) -> str:
        """How the dataset should decode images for this collator (``SkippingDataset(decode=...)``): ``tensor``
        on the tensor path, else ``pil``."""
        return "tensor" if self.images is not None else "pil"

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        images = [e["image"] if isinstance(e["image"], Tensor) else read_image(e["image"]) for e in examples]
        if self.images is None or self._prepares_images:  # the processor and the terms' prepare read PIL images
            pil = [_to_pil(im) for im in images]
            images = pil if self.images is None else images
            examples = [{**e, "image": img} for e, img in zip(examples, pil)]
        tok = self.tokenize([e["caption"] for e in examples])
        batch: dict[str, Any] = {
            "ids": [str(e.get("id", i)) for i, e in enumerate(examples)],
            "input_ids": tok.input_ids,
            "attention_mask": tok.attention_mask,
            "truncated": tok.truncated.to(torch.bool),
        }
        if self.images is not None:
            batch["image_inputs"] = {"pixel_values": self.images(images)}
            batch[PIXEL_NORM] = self.images.norm
        elif any(PRECOMPUTED_SUPERPIXELS in e for e in examples):  # F-CAST: read from the shards, not computed
            given = [e.get(PRECOMPUTED_SUPERPIXELS) for e in examples]
            batch["image_inputs"] = dict(self.preprocess_images(images, superpixels=given))
        else:
            batch["image_inputs"] = dict(self.preprocess_images(images))
        if self.objective is not None:
            prepared = [self.objective.prepare(e) for e in examples]
            batch.update(self.objective.collate(prepared, self._model))
        return batch


def normalize_pixels(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch with ``uint8`` ``image_inputs["pixel_values"]`` normalised where they are (on the device), when
    the collator left them so (:data:`PIXEL_NORM`); other batches are returned as they are."""
    norm: PixelNorm | None = batch.get(PIXEL_NORM)
    if norm is None:
        return batch
    out = {k: v for k, v in batch.items() if k != PIXEL_NORM}
    out["image_inputs"] = {**batch["image_inputs"], "pixel_values": norm.apply(batch["image_inputs"]["pixel_values"])}
    return out
