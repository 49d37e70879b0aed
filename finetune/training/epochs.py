"""What each epoch of a run trained on, in a form a user can check (:class:`EpochLedger`): per epoch, how many samples
the optimiser steps read, an order-free digest of their ids (:func:`ids_digest`), and the ids the loader passed over
(``data.on_error: skip``). Written to ``metrics.json`` (``epochs``) and carried by every checkpoint, so a resumed run,
on any number of processes, reports the whole run.

The digest of a set of ids is the sum, modulo 2**64, of the first 8 bytes of each id's BLAKE2b hash: it does not
depend on the order the samples were read in, nor on how they were split over processes, workers or resumed parts,
and it changes when a sample is read twice or left out. ``ids_digest(ids of the training set)`` is what an epoch that
read every sample once reports.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

from finetune.data.streams import EPOCHS_KEY

__all__ = ["EpochLedger", "count_batch", "ids_digest"]

_MOD = 2 ** 64


def _id_value(sample_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(str(sample_id).encode(), digest_size=8).digest(), "little")


def _hex(value: int) -> str:
    return f"{value % _MOD:016x}"


def ids_digest(ids: Iterable[str]) -> str:
    """The order-free digest of ``ids`` (16 hex digits; see the module): what an epoch that read exactly these samples
    reports in ``metrics.json``'s ``epochs[i].ids_digest``."""
    return _hex(sum(_id_value(i) for i in ids))


class EpochLedger:
    """This process's count of the samples each epoch trained on (:meth:`add`), and the merge of every process's
    (:meth:`merged`). The entries, as ``metrics.json`` holds them: ``{"epoch": e, "read": n, "ids_digest": hex,
    "skipped_ids": [...]}`` (epochs from 0, in order)."""

    def __init__(self) -> None:
        self._read: dict[int, int] = {}
        self._sums: dict[int, int] = {}
        self._skipped: dict[int, set[str]] = {}

    def add(self, ids: Sequence[str], epochs: Sequence[int] | int) -> None:
        """Count a batch: ``ids`` of its samples and the epoch of each (or one epoch for all)."""
        per_sample = [epochs] * len(ids) if isinstance(epochs, int) else list(epochs)
        for sample_id, epoch in zip(ids, per_sample):
            self._read[epoch] = self._read.get(epoch, 0) + 1
            self._sums[epoch] = (self._sums.get(epoch, 0) + _id_value(sample_id)) % _MOD

    def skip(self, ids: Iterable[str], epoch: int) -> None:
        """Note samples of ``epoch`` the loader passed over."""
        self._skipped.setdefault(epoch, set()).update(str(i) for i in ids)

    def entries(self) -> list[dict[str, Any]]:
        """This process's entries (see the class)."""
        epochs = sorted(set(self._read) | set(self._skipped))
        return [{"epoch": e, "read": self._read.get(e, 0), "ids_digest": _hex(self._sums.get(e, 0)),
                 "skipped_ids": sorted(self._skipped.get(e, ()))} for e in epochs]

    def load(self, entries: Sequence[dict[str, Any]]) -> None:
        """Start from saved :meth:`entries` (a checkpoint's, the whole run's until then: load them on one process
        only, since :meth:`merged` sums every process's)."""
        for entry in entries:
            epoch = int(entry["epoch"])
            self._read[epoch] = self._read.get(epoch, 0) + int(entry["read"])
            self._sums[epoch] = (self._sums.get(epoch, 0) + int(entry["ids_digest"], 16)) % _MOD
            if entry.get("skipped_ids"):
                self.skip(entry["skipped_ids"], epoch)

    def merged(self, accelerator: Any) -> list[dict[str, Any]]:
        """Every process's entries summed (a collective: every process calls it), the same on each."""
        parts = [self.entries()]
        if accelerator is not None and accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            parts = gather_object([parts[0]])
        total = EpochLedger()
        for part in parts:
            total.load(part)
        return total.entries()


def count_batch(ledger: EpochLedger, batch: dict[str, Any], step: int, steps_per_epoch: int) -> int:
    """Count ``batch`` (its ``ids``) in ``ledger`` under each sample's epoch: a stream's, given per sample under
    :data:`EPOCHS_KEY` (popped), or map-style data's, ``step // steps_per_epoch`` for the batch of the optimiser
    step after ``step`` (its batches never straddle epochs). Returns the epoch of the batch's last sample."""
    epochs = batch.pop(EPOCHS_KEY, None)
    if epochs is None:
        epochs = step // max(1, steps_per_epoch)
    ledger.add(batch.get("ids") or [], epochs)
    return epochs if isinstance(epochs, int) else int(epochs[-1]) if len(epochs) else 0
