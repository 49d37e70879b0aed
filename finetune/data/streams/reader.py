"""One reader's endless stream of examples (:class:`ExampleStream`): its share of every epoch
(:mod:`~finetune.data.streams.plan`), decoded and checked, bad examples and broken shards counted, with a position
that resumes exactly, or is pooled and split again when a run resumes with another number of readers."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from finetune.data.images import DataError
from finetune.data.spec import SourceSpec
from finetune.data.streams.columns import make_example, resolve_columns
from finetune.data.streams.plan import Intervals, fresh_share, length, reader_blocks
from finetune.data.streams.source import ShardBreak, ShardSet

__all__ = ["EPOCH_FIELD", "ExampleStream", "STATE_VERSION"]

logger = logging.getLogger(__name__)

STATE_VERSION = 3  # 2: datasets' position per worker (shard-level split); 3: sample positions
#: the field each example is given with its epoch (taken out by the loader's collate: ``batch[EPOCHS_KEY]``)
EPOCH_FIELD = "_epoch"
_SKIPPED_KEPT = 5


class ExampleStream(torch.utils.data.IterableDataset):
    """One reader's endless stream of validated examples, epoch after epoch, with a resumable position.

    Yields ``{"id": str, "image": RGB PIL image, "caption": str}`` (plus ``captions`` when the caption column holds
    lists, ``url`` for webdataset shards, ``options.fields``) updated with what ``transform`` returns (the objective's
    :meth:`~finetune.objectives.base.Objective.stream_map`). Columns map as for map-style sources
    (:func:`~finetune.data.streams.columns.resolve_columns`); the id defaults to ``id``, else the webdataset key, else
    ``<name>-<epoch>-<position>``.

    Who reads what: reader ``rank * W + w`` of ``world_size * W`` (``w`` the DataLoader worker, ``W`` the number of
    workers, 1 in the training process) reads its share of each epoch (:func:`~finetune.data.streams.plan.fresh_share`),
    or the share a resume with another layout gave it (:meth:`load_state_dict`).

    Args:
        source: the stream's shards (:func:`~finetune.data.streams.open_stream`).
        spec: its entry (columns, ``seed``, ``shuffle_buffer``); by default the source's.
        on_error: ``skip`` (count bad examples, keep the first few) or ``raise`` (:class:`DataError` on the first,
            naming its id and shard).
        transform: ``example -> extra fields``, run on every good example (in the reader's process).
        rank, world_size: this process and the number of processes (by default the source's).
        keep: good examples kept in :attr:`preview` (for report previews).
    """

    def __init__(self, source: ShardSet, spec: SourceSpec | dict | str | None = None, *, on_error: str = "skip",
                 transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None, rank: int | None = None,
                 world_size: int | None = None, keep: int = 8) -> None:
        if on_error not in ("skip", "raise"):
            raise ValueError(f"on_error must be skip or raise, got {on_error!r}")
        self.source = source
        self.spec = SourceSpec.parse(spec) if spec is not None else source.spec
        self.on_error = on_error
        self.transform = transform
        self.rank = source.rank if rank is None else rank
        self.world_size = source.world_size if world_size is None else world_size
        self.keep = keep
        self.preview: list[dict[str, Any]] = []
        self.epoch = 0
        self.done = 0  # positions of this epoch's share passed (given, skipped or lost to a broken shard)
        self.read = 0
        self.yielded = 0
        self.skipped = 0
        self.skipped_examples: list[dict[str, str]] = []
        #: tar shards that ended early (every time one was met; the first few named, each once)
        self.skipped_shard_count = 0
        self.skipped_shards: list[dict[str, str]] = []
        #: shares given by a resume with another layout, ``{reader: {epoch: intervals}}`` (JSON keys)
        self.assigned: dict[str, dict[str, Intervals]] = {}
        self.shares: dict[str, Intervals] = {}
        self._resumed = False
        self._keys: tuple[str, str, str | None] | None = None
        self._broken_now: str | None = None

    # -- who reads --------------------------------------------------------------------------------
    @property
    def worker(self) -> int:
        """The DataLoader worker reading this stream (0 in the training process)."""
        info = torch.utils.data.get_worker_info()
        return info.id if info is not None else 0

    @property
    def num_workers(self) -> int:
        """The number of DataLoader workers of the loader reading this stream (0: read in the training process)."""
        info = torch.utils.data.get_worker_info()
        return info.num_workers if info is not None else 0

    @property
    def reader(self) -> int:
        """This reader's number among all readers of the run (process-major)."""
        return self.rank * max(1, self.num_workers) + self.worker

    @property
    def readers(self) -> int:
        """Readers of the run: processes x data-loader workers."""
        return self.world_size * max(1, self.num_workers)

    def share(self, epoch: int) -> Intervals:
        """This reader's positions of ``epoch``."""
        if str(epoch) in self.shares:
            return [tuple(x) for x in self.shares[str(epoch)]]
        return fresh_share(self.source.num_examples, self.readers, self.reader, epoch)

    # -- iteration --------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, Any]]:
        if str(self.reader) in self.assigned:  # a resume with another layout: this reader's part of what was left
            self.shares = dict(self.assigned.pop(str(self.reader)))
            self.assigned = {}
        if self.readers > self.source.num_examples:
            raise DataError(
                f"data source {self.spec.name!r} has {self.source.num_examples} samples for {self.readers} readers "
                "(processes x data.num_workers): every reader needs one. Lower data.num_workers or add data")
        resumed = self._resumed
        block = self.spec.shuffle_buffer
        while True:
            share = self.share(self.epoch)
            order = self.source.order(self.epoch)
            usable = 0
            for positions, given in reader_blocks(share, self.done, block, self.spec.seed, self.epoch):
                raws = self._raws(order, positions)
                for position in given if given is not None else raws:
                    raw = raws[position] if given is not None else raws.get(position)
                    self.done += 1
                    example = self._take(position, raw)
                    if example is not None:
                        usable += 1
                        yield {**example, EPOCH_FIELD: self.epoch}  # the epoch it counts in (the run's ledger)
            if not usable and not resumed and length(share):
                self._nothing_usable()
            resumed = False
            self.shares.pop(str(self.epoch), None)
            self.epoch += 1
            self.done = 0

    def _raws(self, order: Any, positions: Intervals) -> Any:
        """Raw samples by position: all of them for a block (a dict), or lazily in order (a dict-like generator)."""
        stream = self._broken_first(self.source.read(order, positions))
        if self.spec.shuffle_buffer > 1:
            return dict(stream)
        return _InOrder(stream)

    def _broken_first(self, items: Iterator) -> Iterator:
        for position, raw in items:
            if position is None:  # after the last sample of a shard the index knows to end early
                self._skip_shard(raw)
                continue
            yield position, raw

    def _take(self, position: int, raw: Any) -> dict[str, Any] | None:
        """The example at ``position`` (None when it is bad, or lost to a broken shard: counted)."""
        if isinstance(raw, ShardBreak):  # counted once for each run of positions it loses
            if self._broken_now != raw.url:
                self._skip_shard(raw)
            self._broken_now = raw.url
            return None
        self._broken_now = None
        self.read += 1
        if self._keys is None:
            self._keys = resolve_columns(self.spec, [k for k in raw if k != "__url__"])
        example, reason, url = make_example(raw, self.spec, self._keys, f"{self.spec.name}-{self.epoch}-{position}")
        if reason is not None:
            self._skip(example["id"], url, reason)
            return None
        if self.transform is not None:
            example.update(self.transform(example))
        self.yielded += 1
        if len(self.preview) < self.keep:
            self.preview.append(example)
        return example

    def _where(self) -> str:
        where = f"process {self.rank} of {self.world_size}"
        if self.num_workers:
            where += f", data-loader worker {self.worker} of {self.num_workers}"
        return where

    def _nothing_usable(self) -> None:
        first = self.skipped_examples[0] if self.skipped_examples else None
        why = f"; the first skipped: id={first['id']!r} in {first['path']}: {first['reason']}" if first else ""
        broken = (f"; broken shards skipped: {', '.join(e['shard'] for e in self.skipped_shards)}"
                  if self.skipped_shards else "")
        raise DataError(
            f"data source {self.spec.name!r}: {self._where()} found no usable examples in epoch {self.epoch} "
            f"({self.read} read, {self.skipped} skipped in all{why}{broken}); check data.train (urls, columns)")

    def _skip_shard(self, broken: ShardBreak) -> None:
        """A tar shard ends early: raise naming it, or skip its rest, counted."""
        if self.on_error == "raise":
            raise DataError(
                f"data source {self.spec.name!r}: shard {broken.url} cannot be read to its end ({broken.reason}): it "
                "is truncated or damaged (the samples before the break were read). Replace or remove the shard, or "
                "set data.on_error: skip to skip the rest of a broken shard (counted in metrics.json)")
        self.skipped_shard_count += 1
        if (broken.url not in {e["shard"] for e in self.skipped_shards}
                and len(self.skipped_shards) < _SKIPPED_KEPT):
            self.skipped_shards.append({"shard": broken.url, "reason": broken.reason})
        logger.warning("data source %r (%s): skipped the rest of shard %s, which ends early (%s); data.on_error: skip",
                       self.spec.name, self._where(), broken.url, broken.reason)

    def _skip(self, ident: str, url: str, reason: str) -> None:
        if self.on_error == "raise":
            raise DataError(
                f"data source {self.spec.name!r}: example id={ident!r}" + (f" (shard {url})" if url else "")
                + f": {reason}. Fix or remove the example, or set data.on_error: skip to skip and count such examples.")
        self.skipped += 1
        if len(self.skipped_examples) < _SKIPPED_KEPT:
            self.skipped_examples.append({"id": ident, "path": url or "<stream>", "reason": reason})
        logger.debug("skipped stream example %s (%s): %s", ident, url, reason)

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position after the last example given (JSON): the reader and the layout, the epoch, the positions of
        its share passed (``done``), the shares a re-split gave it, and the counts. In a DataLoader worker this is the
        worker's position; torchdata's ``StatefulDataLoader`` collects one per worker
        (:class:`~finetune.data.streams.loader.StreamLoader`)."""
        return {
            "version": STATE_VERSION, "name": self.spec.name, "rank": self.rank, "world_size": self.world_size,
            "worker": self.worker, "num_workers": self.num_workers, "reader": self.reader, "readers": self.readers,
            "epoch": self.epoch, "finished": self.finished, "done": self.done, "shares": {k: [list(x) for x in v] for k, v in self.shares.items()},
            "read": self.read, "yielded": self.yielded, "skipped": self.skipped,
            "skipped_examples": list(self.skipped_examples), "skipped_shard_count": self.skipped_shard_count,
            "skipped_shards": list(self.skipped_shards),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` of this same reader (call before iterating; in a worker, the worker's own
        state). A resume with another layout goes through :meth:`assign` instead.

        Raises:
            DataError: the state was saved by another reader or by an older xlipkit.
        """
        if state.get("version") != STATE_VERSION:
            raise DataError(
                f"stream state version {state.get('version')!r} is not {STATE_VERSION}: the checkpoint was saved by an "
                "older xlipkit, whose stream position (a shard split) does not carry over to sample positions; resume "
                "with that version or start the run again")
        if (state["reader"], state["readers"]) != (self.reader, self.readers):
            raise DataError(
                f"the checkpoint's stream position was saved by reader {state['reader']} of {state['readers']} "
                f"(process {state['rank']} of {state['world_size']}), this is reader {self.reader} of {self.readers}: "
                "resume through the loader, which re-splits what is left for another number of processes or workers")
        self.epoch, self.done = int(state["epoch"]), int(state["done"])
        self.shares = {k: [tuple(x) for x in v] for k, v in state.get("shares", {}).items()}
        self.read, self.yielded, self.skipped = int(state["read"]), int(state["yielded"]), int(state["skipped"])
        self.skipped_examples = list(state["skipped_examples"])
        self.skipped_shard_count = int(state.get("skipped_shard_count", 0))
        self.skipped_shards = list(state.get("skipped_shards", []))
        self._resumed = True

    def assign(self, epoch: int, shares: dict[str, dict[str, Intervals]]) -> None:
        """Start at ``epoch`` with the shares a re-split gave each reader (``{reader: {epoch: intervals}}``; each reader
        picks its own when it starts), after a resume with another number of processes or workers (see
        :class:`~finetune.data.streams.loader.StreamLoader`, which carries the counts over)."""
        self.epoch, self.done = epoch, 0
        self.assigned = {k: dict(v) for k, v in shares.items()}
        self.shares = {}
        self._resumed = True

    @property
    def finished(self) -> int:
        """Whole epochs this reader has read (its position may stand at the end of one it has not left yet)."""
        return self.epoch + (self.done >= length(self.share(self.epoch)))

    def report(self) -> dict[str, Any]:
        """Counts for ``metrics.json``: examples read, used and skipped (this reader), the first skipped, the broken
        shards and the epochs it finished."""
        return {"epoch": self.finished, "read": self.read, "used": self.yielded, "skipped": self.skipped,
                "skipped_examples": list(self.skipped_examples), "skipped_shard_count": self.skipped_shard_count,
                "skipped_shards": list(self.skipped_shards)}


class _InOrder:
    """Raw samples of one piece read in position order, looked up by the position the reader expects next (a piece
    without block shuffle is read lazily; positions come in order)."""

    def __init__(self, stream: Iterator[tuple[int, Any]]) -> None:
        self.stream = stream
        self._current: tuple[int, Any] | None = None

    def __iter__(self) -> Iterator[int]:
        for position, raw in self.stream:
            self._current = (position, raw)
            yield position

    def get(self, position: int) -> Any:
        assert self._current is not None and self._current[0] == position
        return self._current[1]
