"""Batching: images through the model's own processor (or its tensor path), captions through its own
tokenizer, plus the fields the objective's terms ask for (DESIGN 3: the data pipeline computes only what the
terms need). Everything here runs where the batch is collated, in the data-loader workers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from .images import PixelNorm, TensorImages, read_image

def _to_pil(image: Any) -> Any:
    """A ``uint8 (3, H, W)`` tensor as an RGB PIL image (PIL images pass through)."""
    if not isinstance(image, Tensor):
        return image
    import PIL.Image

    return PIL.Image.fromarray(image.permute(1, 2, 0).contiguous().numpy())


__all__ = ["Collator", "PlannedCollate", "MicroPlans", "EPOCH_KEY", "PIXEL_NORM", "compile_lengths", "normalize_pixels",
           "split_batch"]

#: batch key of the :class:`~finetune.data.images.PixelNorm` of ``uint8`` ``image_inputs`` (host metadata)
PIXEL_NORM = "_pixel_norm"
#: example key of superpixel labels decoded from a stream's precomputed entry (F-CAST's term), handed to the model's
#: ``preprocess_images(images, superpixels=...)`` so that the worker does not compute them
PRECOMPUTED_SUPERPIXELS = "superpixels"
#: example key of the epoch an example is drawn for (``finetune.training.loaders.EpochIndexed``), read by :class:`PlannedCollate`
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
            :data:`PIXEL_NORM`, to be normalised on the device (:func:`normalize_pixels`, which the trainer
            calls); where the model's processor is not covered (NaFlex, F-CAST's superpixels) it stays in use.
            The training loop's collator sets it; the default keeps ``float`` pixels ready for ``encode_image``.
    """

    def __init__(self, model: Any, objective: Any = None, *, tensor_images: bool = False) -> None:
        self.preprocess_images = model.preprocess_images
        self.tokenize = model.tokenize
        self.objective = objective
        self._model = model
        self.images = TensorImages.for_model(model) if tensor_images else None
        from finetune.objectives.base import Term

        terms = objective.all_terms if objective is not None else []
        self._prepares_images = any(type(t).prepare is not Term.prepare for t in terms)

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


def compile_lengths(max_len: int, step: int = 32) -> tuple[int, ...]:
    """The text lengths captions are padded to under ``train.compile``: multiples of ``step`` below ``max_len``,
    then ``max_len`` (``(32, 64, 77)`` for CLIP, ``(32, ..., 224, 248)`` with KPS), so that compiled towers see
    a few shapes instead of one per batch."""
    return tuple(range(step, max_len, step)) + (max_len,)


@dataclass
class MicroPlans:
    """The :class:`~finetune.objectives.base.TextPlan` of each micro-batch of an accumulated step (host
    metadata; ``to`` / ``pin_memory`` move their tensors with the batch)."""

    plans: list[Any]

    def to(self, device: Any, non_blocking: bool = False) -> "MicroPlans":
        return MicroPlans([p.to(device, non_blocking=non_blocking) if hasattr(p, "to") else p for p in self.plans])

    def pin_memory(self) -> "MicroPlans":
        return MicroPlans([p.pin_memory() if hasattr(p, "pin_memory") else p for p in self.plans])


class PlannedCollate:
    """Wraps a collate function for the training loop: gives the terms the batch's epoch (per-epoch choices made in
    ``prepare``, in the worker's copy of the objective), adds the batch's text plan
    (:meth:`~finetune.objectives.base.Objective.plan`, the length buckets of its causal text requests, made here
    on the CPU so that the step reads no lengths from the device), the terms' own host values
    (:meth:`~finetune.objectives.base.Term.plan`, e.g. F-CAST's segment count, under
    :data:`~finetune.objectives.base.TERM_PLANS` when a term plans anything) and, under ``train.compile``, pads the
    captions to a fixed set of lengths.

    Args:
        collate_fn: examples -> batch (a :class:`Collator`, possibly wrapped).
        objective: the objective whose requests are planned.
        model: the model (its family decides which requests are bucketed).
        micro_batches: ``train.accumulation_steps``: one plan per micro-batch (:func:`split_batch`).
        pad_lengths: sorted lengths that caption tensors and buckets are padded up to (:func:`compile_lengths`),
            or None.
    """

    def __init__(self, collate_fn: Callable[[list[dict]], dict[str, Any]], objective: Any, model: Any, *,
                 micro_batches: int = 1, pad_lengths: tuple[int, ...] | None = None) -> None:
        self.collate_fn = collate_fn
        self.objective = objective
        self.model = model
        self.micro_batches = micro_batches
        self.pad_lengths = tuple(pad_lengths) if pad_lengths else None
        self._epoch: int | None = None

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        from finetune.objectives.base import TERM_PLANS, TEXT_PLAN

        epochs = {e.pop(EPOCH_KEY) for e in examples if EPOCH_KEY in e}
        if len(epochs) == 1 and self._epoch not in epochs:  # this process's copy of the terms learns the epoch
            self._epoch = epochs.pop()
            for term in self.objective.all_terms:
                term.set_epoch(self._epoch)
        batch = self.collate_fn(examples)
        if self.pad_lengths:
            batch.update(self._padded(batch["input_ids"], batch["attention_mask"]))
        plan, term_plans = self.objective.plan, self.objective.term_plans
        if self.micro_batches == 1:
            batch[TEXT_PLAN] = plan(self.model, batch, pad_lengths=self.pad_lengths)
            terms = term_plans(self.model, batch)
        else:
            parts = split_batch(batch, self.micro_batches)
            batch[TEXT_PLAN] = MicroPlans([plan(self.model, p, pad_lengths=self.pad_lengths) for p in parts])
            terms = [term_plans(self.model, p) for p in parts]
            terms = MicroPlans(terms) if any(terms) else None
        if terms:  # the terms' host values (Term.plan), per micro-batch
            batch[TERM_PLANS] = terms
        return batch

    def _padded(self, ids: Tensor, mask: Tensor) -> dict[str, Tensor]:
        width = ids.shape[1]
        target = next((p for p in self.pad_lengths if p >= width), width)
        if target == width:
            return {}
        pad = getattr(getattr(self.model, "tokenizer", None), "pad_token_id", None) or 0
        right = (0, target - width)
        return {"input_ids": torch.nn.functional.pad(ids, right, value=pad),
                "attention_mask": torch.nn.functional.pad(mask, right, value=0)}


def split_batch(batch: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """Split a collated batch into ``n`` equal micro-batches along dim 0 of every per-sample field (tensors and
    lists with one entry per sample); a :class:`MicroPlans` gives each micro-batch its own plan (text plan, terms'
    plans)."""
    from finetune.objectives.base import TERM_PLANS, TEXT_PLAN

    if n == 1:
        return [batch]
    size = len(batch["input_ids"])
    step = size // n
    plans = batch.get(TEXT_PLAN)
    terms = batch.get(TERM_PLANS)
    parts = []
    for i in range(n):
        sl = slice(i * step, (i + 1) * step)
        part = {k: _slice(v, sl, size) for k, v in batch.items() if k not in (TEXT_PLAN, TERM_PLANS)}
        part[TEXT_PLAN] = plans.plans[i] if isinstance(plans, MicroPlans) else None
        if isinstance(terms, MicroPlans) and terms.plans[i]:
            part[TERM_PLANS] = terms.plans[i]
        parts.append(part)
    return parts


def _slice(obj: Any, sl: slice, size: int) -> Any:
    if isinstance(obj, dict):
        return {k: _slice(v, sl, size) for k, v in obj.items()}
    if isinstance(obj, (Tensor, list)) and len(obj) == size:
        return obj[sl]
    return obj
