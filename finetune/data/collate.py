"""Batching: images through the model's own processor, captions through its own tokenizer, plus the
fields the objective's terms ask for (DESIGN 3: the data pipeline computes only what the terms need)."""

from __future__ import annotations

from typing import Any

import torch

from .images import read_image


class Collator:
    """``examples -> batch`` for training and evaluation.

    The batch holds ``ids`` (list[str]), ``image_inputs`` (the keyword inputs of ``encode_image``:
    ``pixel_values (B, 3, H, W)`` and, for NaFlex, its masks), ``input_ids`` / ``attention_mask``
    ``(B, L)``, ``truncated`` ``(B,)`` bool, and the objective's fields.

    Args:
        model: the DualEncoder whose ``preprocess_images`` and ``tokenize`` are used.
        objective: an :class:`~finetune.objectives.base.Objective` (or None for plain image-caption
            batches).
    """

    def __init__(self, model: Any, objective: Any = None) -> None:
        self.preprocess_images = model.preprocess_images
        self.tokenize = model.tokenize
        self.objective = objective
        self._model = model

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        images = [read_image(e["image"]) for e in examples]
        examples = [{**e, "image": img} for e, img in zip(examples, images)]
        tok = self.tokenize([e["caption"] for e in examples])
        batch: dict[str, Any] = {
            "ids": [str(e.get("id", i)) for i, e in enumerate(examples)],
            "image_inputs": dict(self.preprocess_images(images)),
            "input_ids": tok.input_ids,
            "attention_mask": tok.attention_mask,
            "truncated": tok.truncated.to(torch.bool),
        }
        if self.objective is not None:
            prepared = [self.objective.prepare(e) for e in examples]
            batch.update(self.objective.collate(prepared, self._model))
        return batch
