"""The training loaders of map-style data: one seeded permutation per epoch, cut to whole batches as ``drop_last``
does, from the current step on, in ONE pass of a ``DataLoader`` whose workers stay up over the whole run
(:class:`EpochShuffleSampler` over :class:`EpochIndexed`); a resumed run sees the same batches as a straight one.
Streams have their own loader (:class:`finetune.data.streams.StreamLoader`)."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Sampler

from finetune.data.collate import EPOCH_KEY
from finetune.training.signals import worker_signals

__all__ = ["EpochIndexed", "EpochShuffleSampler", "PREFETCH_BATCHES", "map_loader"]

#: batches each data-loader worker keeps ready (``DataLoader(prefetch_factor=...)``)
PREFETCH_BATCHES = 4


class EpochShuffleSampler(Sampler[tuple[int, int]]):
    """``(epoch, index)`` for every example of the steps ``start_step .. total_steps``, epoch after epoch: each
    epoch a permutation of ``range(n)`` drawn from ``seed + epoch`` (the same order on every resume), cut to whole
    batches as ``drop_last`` does, so that ``DataLoader(batch_size=batch_size)`` over it gives the same batches as
    one shuffled pass per epoch.

    One pass over it spans the whole run: the data-loader workers (persistent, prefetching) never drain at an
    epoch boundary, a resumed run starts where it stopped without loading the batches it skips, and the epoch
    travels with each index to the workers (:class:`EpochIndexed`), where per-epoch choices of the terms (FLAIR's
    sub-captions) are made.
    """

    def __init__(self, n: int, seed: int, batch_size: int = 1) -> None:
        self.n = n
        self.seed = seed
        self.batch_size = batch_size
        self.steps_per_epoch = n // batch_size
        self.start_step = 0
        self.total_steps = self.steps_per_epoch

    def set_epoch(self, epoch: int) -> None:
        """Accepted for the loaders that call it; the epochs follow from the steps."""

    def __iter__(self) -> Iterator[tuple[int, int]]:
        step, b = self.start_step, self.batch_size
        while step < self.total_steps:
            epoch, within = divmod(step, self.steps_per_epoch)
            g = torch.Generator().manual_seed(self.seed + epoch)
            stop = min(self.steps_per_epoch, within + self.total_steps - step)
            for i in torch.randperm(self.n, generator=g)[within * b:stop * b].tolist():
                yield epoch, i
            step += stop - within

    def __len__(self) -> int:
        return max(0, self.total_steps - self.start_step) * self.batch_size


class EpochIndexed:
    """A map-style dataset read by ``(epoch, index)`` (:class:`EpochShuffleSampler`): row ``index`` with the
    epoch under :data:`finetune.data.collate.EPOCH_KEY`, which
    :class:`finetune.objectives.planning.PlannedCollate` hands to the terms in the worker that collates the batch."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> dict[str, Any]:
        epoch, index = key
        return {**self.dataset[index], EPOCH_KEY: epoch}

    def __getitems__(self, keys: list[tuple[int, int]]) -> list[dict[str, Any]]:
        """A batch of rows in one call of the dataset's ``__getitems__`` where it has one (a columnar read)."""
        many = getattr(self.dataset, "__getitems__", None)
        if many is None:
            return [self[key] for key in keys]
        return [{**row, EPOCH_KEY: epoch} for (epoch, _), row in zip(keys, many([i for _, i in keys]))]



def map_loader(dataset: Any, collate_fn: Callable, cfg: Any,
               num_workers: int) -> tuple[DataLoader, EpochShuffleSampler]:
    """The loader of a map-style ``dataset`` and its sampler: the GLOBAL batch of one optimiser step
    (``train.batch_size``; accelerate splits it over processes, the trainer each process's share into micro-batches),
    shuffled per epoch from ``train.seed``, over ``train.max_steps`` or ``train.epochs`` epochs.

    Raises:
        ValueError: fewer examples than one batch (naming ``train.batch_size``).
    """
    if len(dataset) < cfg.batch_size:
        raise ValueError(
            f"the training set has {len(dataset)} examples, fewer than train.batch_size="
            f"{cfg.batch_size}: lower train.batch_size or add data"
        )
    sampler = EpochShuffleSampler(len(dataset), cfg.seed, cfg.batch_size)
    if sampler.steps_per_epoch == 0:
        raise ValueError("the training set is smaller than one optimiser step; lower train.batch_size")
    sampler.total_steps = cfg.max_steps or cfg.epochs * sampler.steps_per_epoch
    # workers stay up and keep batches ready over the whole run (one pass of the sampler spans every epoch);
    # batches are not pinned: DevicePrefetcher copies them on a side stream (finetune.data.prefetch)
    loader = DataLoader(
        EpochIndexed(dataset),
        batch_size=cfg.batch_size,
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=True,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        prefetch_factor=PREFETCH_BATCHES if num_workers > 0 else None,
        worker_init_fn=worker_signals() if num_workers > 0 else None,
        generator=torch.Generator().manual_seed(cfg.seed),
    )
    return loader, sampler
