"""The training loaders of map-style data: one seeded permutation per epoch, cut to whole batches as ``drop_last``
does, from the current step on, in ONE pass of a ``DataLoader`` whose workers stay up over the whole run
(:class:`EpochShuffleSampler` over :class:`EpochIndexed`); a resumed run sees the same batches as a straight one.
With ``train.group_by_length`` (opt-in) the batches of an epoch hold captions of similar lengths
(:class:`LengthGroupedEpochSampler`). Streams have their own loader (:class:`finetune.data.streams.StreamLoader`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Sampler

from finetune.config.values import GROUP_KEY, STREAM_GROUPING
from finetune.data.collate import EPOCH_KEY
from finetune.training.signals import worker_signals

__all__ = ["EpochIndexed", "EpochShuffleSampler", "GROUP_KEY", "LengthGroupedEpochSampler", "PREFETCH_BATCHES",
           "STREAM_GROUPING", "map_loader"]

log = logging.getLogger("xlipkit")

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

    def epoch_order(self, epoch: int) -> list[int]:
        """The examples of ``epoch`` in the order they are read, ``steps_per_epoch * batch_size`` of them (each batch
        ``batch_size`` consecutive ones): a permutation of ``range(n)`` drawn from ``seed + epoch``, its tail of fewer
        than a batch left out (``drop_last``)."""
        return self._kept(torch.Generator().manual_seed(self.seed + epoch))

    def _kept(self, g: torch.Generator) -> list[int]:
        """The first draw of an epoch's generator ``g``: the permutation, cut to whole batches."""
        return torch.randperm(self.n, generator=g)[:self.steps_per_epoch * self.batch_size].tolist()

    def __iter__(self) -> Iterator[tuple[int, int]]:
        step, b = self.start_step, self.batch_size
        while step < self.total_steps:
            epoch, within = divmod(step, self.steps_per_epoch)
            stop = min(self.steps_per_epoch, within + self.total_steps - step)
            for i in self.epoch_order(epoch)[within * b:stop * b]:
                yield epoch, i
            step += stop - within

    def __len__(self) -> int:
        return max(0, self.total_steps - self.start_step) * self.batch_size


class LengthGroupedEpochSampler(EpochShuffleSampler):
    """:class:`EpochShuffleSampler` whose batches hold examples of similar lengths (``train.group_by_length``), so
    that a text pass, padded to the bucket of its longest row, computes little padding.

    Each epoch keeps the examples the plain sampler keeps (the same seeded permutation, the same tail of fewer than a
    batch left out), groups them with transformers' ``get_length_grouped_indices`` (a fresh permutation cut into
    megabatches of ``megabatch`` batches, each sorted by length, longest first, and cut into batches), then shuffles
    the order of the batches, so that long and short batches follow each other at random rather than in the
    megabatches' descending runs. Every draw comes from ``seed + epoch``: a resumed run sees the batches of a straight
    one, and every process the same global batch (accelerate gives each its slice).

    Which captions share a batch, and so which are each other's negatives in a contrastive loss, is this toolkit's
    choice, not the papers' (they draw batches uniformly): hence off by default.

    Args:
        lengths: per example (row order), the tokens of the text whose pass length it decides (its caption, or a
            longer text encoded with it): ``BatchShapes.text_lengths``, from the scan that planned the buckets.
        seed, batch_size: as :class:`EpochShuffleSampler`.
        megabatch: batches per megabatch (None: transformers' default, 50 or a quarter of an epoch's batches,
            whichever is smaller, at least 1). Larger groups tighter and leaves less chance in which examples meet.

    Raises:
        ValueError: ``lengths`` is empty, or ``megabatch`` is below 1.
    """

    def __init__(self, lengths: Sequence[int], seed: int, batch_size: int = 1, megabatch: int | None = None) -> None:
        if not len(lengths):
            raise ValueError(f"{GROUP_KEY}: no example lengths to group by (the training set was not scanned)")
        if megabatch is not None and megabatch < 1:
            raise ValueError(f"{GROUP_KEY}: {megabatch} batches per megabatch; give 1 or more")
        super().__init__(len(lengths), seed, batch_size)
        self.lengths = [int(n) for n in lengths]
        self.megabatch = megabatch

    def epoch_order(self, epoch: int) -> list[int]:
        """The examples of the plain sampler's ``epoch`` (:meth:`EpochShuffleSampler.epoch_order`), grouped by
        length into batches whose order is then shuffled (class docstring)."""
        from transformers.trainer_pt_utils import get_length_grouped_indices

        g = torch.Generator().manual_seed(self.seed + epoch)
        kept = self._kept(g)  # the plain sampler's examples; the draws below continue from g
        if not kept:
            return kept
        grouped = get_length_grouped_indices([self.lengths[i] for i in kept], self.batch_size,
                                             mega_batch_mult=self.megabatch, generator=g)
        b = self.batch_size
        batches = [grouped[s:s + b] for s in range(0, len(grouped), b)]
        return [kept[j] for k in torch.randperm(len(batches), generator=g).tolist() for j in batches[k]]


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



def map_loader(dataset: Any, collate_fn: Callable, cfg: Any, num_workers: int,
               lengths: Sequence[int] | None = None) -> tuple[DataLoader, EpochShuffleSampler]:
    """The loader of a map-style ``dataset`` and its sampler: the GLOBAL batch of one optimiser step
    (``train.batch_size``; accelerate splits it over processes, the trainer each process's share into micro-batches),
    shuffled per epoch from ``train.seed``, over ``train.max_steps`` or ``train.epochs`` epochs; with
    ``train.group_by_length`` the batches group examples of similar ``lengths`` (:class:`LengthGroupedEpochSampler`,
    ``train.length_group_batches`` batches per megabatch).

    Raises:
        ValueError: fewer examples than one batch (naming ``train.batch_size``); ``train.group_by_length`` without
            one length per example.
    """
    if len(dataset) < cfg.batch_size:
        raise ValueError(
            f"the training set has {len(dataset)} examples, fewer than train.batch_size="
            f"{cfg.batch_size}: lower train.batch_size or add data"
        )
    if getattr(cfg, "group_by_length", False):
        if lengths is None or len(lengths) != len(dataset):
            raise ValueError(
                f"{GROUP_KEY}: the training set has {len(dataset)} examples but "
                f"{'no' if lengths is None else len(lengths)} caption lengths were measured; set {GROUP_KEY}: false")
        sampler: EpochShuffleSampler = LengthGroupedEpochSampler(
            lengths, cfg.seed, cfg.batch_size, getattr(cfg, "length_group_batches", None))
        per = sampler.megabatch or max(1, min(sampler.steps_per_epoch // 4, 50))  # transformers' default
        log.info("%s: each batch holds captions of similar lengths (%d to %d tokens in the training set), sorted "
                 "together %d batches at a time; the batches' order is shuffled", GROUP_KEY, min(lengths),
                 max(lengths), per)
    else:
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
