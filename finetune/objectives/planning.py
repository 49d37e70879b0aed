"""Batches planned where they are collated, on the CPU (the data-loader workers), for the training step: the host
facts the step would otherwise read from the device, and the micro-batch split of an accumulated step.

The collate function of the training loop is a :class:`PlannedCollate` (the loop's collate stack is built in one
place, :func:`finetune.training.batches.collate_stack`): it tells the objective the epoch its examples were drawn for
(:data:`~finetune.data.collate.EPOCH_KEY`, set by the map-style sampler and by a stream's loader), adds the batch's
:class:`~finetune.objectives.encoders.TextPlan` and the terms' own plans (:meth:`~finetune.objectives.base.Term.plan`,
e.g. F-CAST's segment count), so that the step reads no size or mask back from the device. The run's shapes are
planned before (:func:`~finetune.objectives.shapes.plan_shapes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from finetune.data.collate import EPOCH_KEY

from .base import N_SAMPLES, TERM_PLANS, TEXT_PLAN, Features

__all__ = ["MicroPlans", "PlannedCollate", "merge_features", "split_batch"]


@dataclass
class MicroPlans:
    """The terms' plans of each micro-batch of an accumulated step (host metadata; ``to`` / ``pin_memory`` move
    any tensors they hold with the batch)."""

    plans: list[Any]

    def to(self, device: Any, non_blocking: bool = False) -> "MicroPlans":
        return MicroPlans([p.to(device, non_blocking=non_blocking) if hasattr(p, "to") else p for p in self.plans])

    def pin_memory(self) -> "MicroPlans":
        return MicroPlans([p.pin_memory() if hasattr(p, "pin_memory") else p for p in self.plans])


class PlannedCollate:
    """Wraps a collate function for the training loop (module docstring).

    Args:
        collate_fn: examples -> batch (a :class:`~finetune.data.collate.Collator`, possibly wrapped).
        objective: the objective whose requests are planned (its :attr:`shapes` are what the batches are padded to).
        model: the model (its family decides which requests may skip their padding mask).
        micro_batches: ``train.accumulation_steps``: one terms' plan per micro-batch (:func:`split_batch`).
    """

    def __init__(self, collate_fn: Callable[[list[dict]], dict[str, Any]], objective: Any, model: Any, *,
                 micro_batches: int = 1) -> None:
        self.collate_fn = collate_fn
        self.objective = objective
        self.model = model
        self.micro_batches = micro_batches
        self._epoch: int | None = None

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        epochs = {e.pop(EPOCH_KEY) for e in examples if EPOCH_KEY in e}
        if len(epochs) == 1 and self._epoch not in epochs:  # this process's copy of the terms learns the epoch
            self._epoch = epochs.pop()
            self.objective.set_epoch(self._epoch)
        batch = self.collate_fn(examples)
        batch[TEXT_PLAN] = self.objective.plan(self.model, batch)
        term_plans = self.objective.term_plans
        if self.micro_batches == 1:
            terms = term_plans(self.model, batch)
        else:
            parts = [term_plans(self.model, p) for p in split_batch(batch, self.micro_batches)]
            terms = MicroPlans(parts) if any(parts) else None
        if terms:  # the terms' host values (Term.plan), per micro-batch
            batch[TERM_PLANS] = terms
        return batch


def split_batch(batch: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """Split a collated batch into ``n`` equal micro-batches along dim 0 of every per-sample field (tensors and
    lists with one entry per sample); a :class:`MicroPlans` gives each micro-batch its own terms' plan, the text plan
    holds for every part."""
    if n == 1:
        return [batch]
    size = len(batch["input_ids"])
    step = size // n
    terms = batch.get(TERM_PLANS)
    parts = []
    for i in range(n):
        sl = slice(i * step, (i + 1) * step)
        part = {k: _slice(v, sl, size) for k, v in batch.items() if k not in (TEXT_PLAN, TERM_PLANS)}
        part[TEXT_PLAN] = batch.get(TEXT_PLAN)
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


def merge_features(parts: list[Features]) -> Features:
    """Concatenate the features of micro-batches as if they were encoded from one batch.

    Every tensor is concatenated along dim 0; ``*_owner`` rows are offset by the number of samples of the
    micro-batches before them; ``n_samples`` is summed; ``image_grid`` is taken from the first part.
    """
    if len(parts) == 1:
        return parts[0]
    merged: Features = {}
    offsets = [0]
    for p in parts[:-1]:
        offsets.append(offsets[-1] + int(p[N_SAMPLES]))
    for key in parts[0]:
        if key == N_SAMPLES:
            merged[key] = torch.tensor(offsets[-1] + int(parts[-1][N_SAMPLES]))
        elif key == "image_grid":
            merged[key] = parts[0][key]
        elif key.endswith("_owner"):
            merged[key] = torch.cat([p[key] + off for p, off in zip(parts, offsets)])
        else:
            merged[key] = torch.cat([p[key] for p in parts])
    return merged
