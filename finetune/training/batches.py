"""The batches of the training loop: the collate stack, built in this one place (:func:`collate_stack`), the loader
over the training set (:func:`open_batches`: map-style data or a stream), and the batches of the optimiser steps
from a given step on, on the device, each with its epoch (:class:`Batches`).

The collate stack, innermost first: the collator (:class:`finetune.data.collate.Collator`: the model's tokenizer and
image geometry on ``uint8`` tensors, the objective's fields), the rows passed over by ``data.on_error: skip``
reported with the batch (:class:`~finetune.data.skipping.SkipReportingCollate`, over a
:class:`~finetune.data.skipping.SkippingDataset` for map-style data; a stream skips its own), the plan of the batch
(:class:`finetune.objectives.planning.PlannedCollate`: the epoch told to the workers' copy of the objective, the text
plan, the terms' plans per micro-batch); then the loader: map-style data through
:func:`~finetune.training.loaders.map_loader` (one seeded shuffle per epoch over one pass of persistent workers),
a stream through :class:`finetune.data.streams.StreamLoader` (which adds each example's epoch and the reader's
position). The batches reach the device through :class:`finetune.data.prefetch.DevicePrefetcher`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from finetune.data.collate import Collator
from finetune.data.prefetch import DevicePrefetcher
from finetune.data.skipping import SKIPPED_KEY, SkippingDataset, SkipReportingCollate
from finetune.data.streams import StreamLoader
from finetune.objectives.planning import PlannedCollate
from finetune.training.checkpoint import TrainState
from finetune.training.epochs import EpochLedger, count_batch
from finetune.training.loaders import STREAM_GROUPING, map_loader
from finetune.training.signals import worker_signals

log = logging.getLogger("xlipkit")

__all__ = ["Batches", "collate_stack", "open_batches", "streaming"]


def streaming(rows: Any) -> bool:
    """Whether ``rows`` is a stream (a torch ``IterableDataset``) rather than map-style data."""
    return isinstance(rows, torch.utils.data.IterableDataset)


def collate_stack(model: Any, objective: Any, rows: Any, cfg: Any, *, on_error: str = "raise",
                  collate_fn: Callable[[list[dict]], dict[str, Any]] | None = None) -> tuple[Any, PlannedCollate]:
    """The training rows and the collate function of the loop (module docstring), in this one place.

    Args:
        model: the model being trained (its tokenizer and image geometry); ``objective``: its objective.
        rows: the training set after the objective's preprocessing, or a stream.
        cfg: the recipe's ``train`` section (``accumulation_steps``: one terms' plan per micro-batch).
        on_error: ``data.on_error``: what an unreadable image of map-style data does (``skip`` or ``raise``).
        collate_fn: examples -> batch in place of the collator and the skipping (a test's or benchmark's own); the
            plan and the loader stay.
    """
    if collate_fn is None:
        collator = Collator(model, objective, tensor_images=True)  # uint8 pixels, normalised on the device
        if not streaming(rows):
            rows = SkippingDataset(rows, on_error, decode=collator.decode)
        collate_fn = SkipReportingCollate(collator)
    return rows, PlannedCollate(collate_fn, objective, model, micro_batches=int(cfg.accumulation_steps))


def open_batches(accelerator: Any, rows: Any, collate_fn: Callable, cfg: Any, state: TrainState, *,
                 num_workers: int = 0, lengths: Sequence[int] | None = None) -> "Batches":
    """The loader of ``rows`` (:class:`Batches`).

    A stream gets its own loader (:class:`~finetune.data.streams.StreamLoader`): each process reads its own share with
    ``num_workers`` workers, batches of its share of the global batch, and keeps a resumable position; it runs
    ``train.max_steps`` steps. Map-style data: :func:`~finetune.training.loaders.map_loader` (the global batch;
    accelerate splits it over the processes with ``split_batches=True``, prepared here without placing batches on the
    device, which :class:`~finetune.data.prefetch.DevicePrefetcher` does), over ``train.max_steps`` or
    ``train.epochs``; ``lengths`` (per example, :attr:`~finetune.objectives.shapes.BatchShapes.text_lengths`) are
    what ``train.group_by_length`` groups its batches by.

    Raises:
        ValueError: a stream without ``train.max_steps``, or with ``train.group_by_length``; fewer examples than one
            batch; ``train.group_by_length`` without one length per example.
    """
    if streaming(rows):
        if not cfg.max_steps:
            raise ValueError("a streamed training set has no length: set train.max_steps")
        if getattr(cfg, "group_by_length", False):
            raise ValueError(STREAM_GROUPING)
        stream = StreamLoader(rows, batch_size=cfg.batch_size // accelerator.num_processes, collate_fn=collate_fn,
                              num_workers=num_workers, worker_init_fn=worker_signals())
        return Batches(stream, accelerator.device, state, batch_size=cfg.batch_size, total_steps=cfg.max_steps,
                       stream=stream)
    loader, sampler = map_loader(rows, collate_fn, cfg, num_workers, lengths)
    loader = accelerator.prepare_data_loader(loader, device_placement=False)
    return Batches(loader, accelerator.device, state, batch_size=cfg.batch_size, total_steps=sampler.total_steps,
                   sampler=sampler)


class Batches:
    """The batches of the optimiser steps from a given step on (:meth:`from_step`), on the device, each with its epoch.

    Map-style data: one pass of the loader from the step on (its sampler, :class:`EpochShuffleSampler`, starts there
    and draws one seeded permutation per epoch: a resumed run sees the batches a straight one does); the epoch of a
    batch is its step over the steps of an epoch. A stream: its loader continues from its position, epoch after epoch,
    opened again should it end; a batch's epoch is its reader's.

    Attributes:
        loader: what the batches are read from (a ``DataLoader``, or the :class:`StreamLoader`).
        stream: the :class:`StreamLoader` of a stream, else None; ``sampler``: the map-style loader's sampler.
        steps_per_epoch: optimiser steps of one epoch of map-style data (0 for a stream).
        total_steps: the run's optimiser steps (``train.max_steps``, or the epochs' steps).
        batch_size: ``train.batch_size``, the global batch of one step.
    """

    def __init__(self, loader: Any, device: torch.device, state: TrainState, *, batch_size: int, total_steps: int,
                 stream: StreamLoader | None = None, sampler: Any = None) -> None:
        self.loader, self.stream, self.sampler, self.state = loader, stream, sampler, state
        self.steps_per_epoch = sampler.steps_per_epoch if sampler is not None else 0
        self.total_steps, self.batch_size = total_steps, batch_size
        self.prefetcher = DevicePrefetcher((), device)

    def from_step(self, first: int, clock: Any = None) -> Iterator[tuple[int, dict[str, Any]]]:
        """``(epoch, batch on the device)`` for the steps after ``first`` up to :attr:`total_steps` (what the batch
        read is noted by :meth:`note_read`); the time spent waiting for each batch is added to ``clock.wait_s`` (a
        :class:`~finetune.training.throughput.LoopClock`)."""
        host = self._host_batches(first)
        for _ in range(first, self.total_steps):
            waited = time.perf_counter()
            epoch, batch = next(host)
            batch = self.prefetcher.move(batch)
            if clock is not None:
                clock.wait_s += time.perf_counter() - waited
            yield epoch, batch

    def _host_batches(self, first: int) -> Iterator[tuple[int, dict[str, Any]]]:
        """The loader's batches (on the host) from step ``first`` on, with their epochs."""
        if self.stream is not None:
            while True:  # a stream that ended is opened again (it counts its epochs)
                for batch in self.stream:
                    yield self.stream.epoch, batch
        self.sampler.start_step, self.sampler.total_steps = first, self.total_steps
        for step, batch in enumerate(self.loader, start=first):
            yield step // self.steps_per_epoch, batch

    def epoch_at(self, step: int) -> float:
        """The global epoch after ``step`` optimiser steps, in epochs of the whole training set (every process and
        worker together): the examples drawn so far over the examples of one epoch (a stream: its samples, bad ones
        included; map-style data: the steps of an epoch)."""
        if self.stream is not None:
            return step * self.batch_size / max(1, self.stream.stream.source.num_examples)
        return step / max(1, self.steps_per_epoch)

    def note_read(self, batch: dict[str, Any], step: int, ledger: EpochLedger) -> None:
        """What the batch of the optimiser step after ``step`` read: its samples under their epochs in ``ledger``
        (:func:`~finetune.training.epochs.count_batch`: a stream's per sample, map-style data's the step's), and the
        examples the data loader passed over (unreadable images, ``data.on_error: skip``) in the ledger under that
        epoch and in the state, each once, with a warning. Both keys leave the batch."""
        epoch = count_batch(ledger, batch, step, self.steps_per_epoch)
        ledger.skip([e["id"] for e in batch.get(SKIPPED_KEY) or ()], epoch)
        known = {e["id"] for e in self.state.skipped_examples}
        for entry in batch.pop(SKIPPED_KEY, None) or ():
            if entry["id"] not in known:
                known.add(entry["id"])
                self.state.skipped_examples.append(entry)
                log.warning("training example id=%s (image %s) skipped: %s", entry["id"], entry["path"],
                            entry["reason"])
