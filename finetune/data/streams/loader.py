"""A process's batches of a stream (:class:`StreamLoader`): torchdata's ``StatefulDataLoader`` over an
:class:`~finetune.data.streams.reader.ExampleStream`, read by ``data.num_workers`` workers that decode, transform and
collate whole batches, with a position that resumes exactly on the same layout and is re-split on another one."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from finetune.data.collate import EPOCH_KEY
from finetune.data.images import DataError
from finetune.data.streams.plan import remaining, split
from finetune.data.streams.reader import EPOCH_FIELD, STATE_VERSION, ExampleStream

__all__ = ["EPOCHS_KEY", "STREAM_KEY", "StreamCollate", "StreamLoader"]

logger = logging.getLogger(__name__)

_LOADER_STATE_VERSION = 3  # 2: one datasets position per worker; 3: sample positions, re-split on another layout
_SKIPPED_KEPT = 5
#: batch key under which a stream batch carries its reader's state to the training process
STREAM_KEY = "_stream"
#: batch key of the epoch of each of a batch's samples (an epoch's last batch of a reader ends with the next one's)
EPOCHS_KEY = "_epochs"
_COUNTS = ("read", "used", "skipped", "skipped_shard_count")


def _unique_shards(entries: Iterable[dict[str, str]]) -> list[dict[str, str]]:
    """The first few skipped shards, each once."""
    out: dict[str, dict[str, str]] = {}
    for entry in entries:
        out.setdefault(entry["shard"], entry)
    return list(out.values())[:_SKIPPED_KEPT]


class StreamCollate:
    """The collate function of a :class:`StreamLoader`, run where the batch's examples were read (a worker): gives
    every example the reader's epoch under :data:`~finetune.data.collate.EPOCH_KEY` (the training loop's collate
    function tells the objective, whose per-example work, e.g. FLAIR's sub-caption draws, depends on it, as it does for
    map-style data) and adds ``batch[STREAM_KEY]`` = the reader's worker id and position after this batch, and
    ``batch[EPOCHS_KEY]`` = the epoch of each example.

    Args:
        collate_fn: examples -> batch (the model's image preprocessing and tokenizer, the objective's fields).
        stream: the stream iterated in the training process (``num_workers`` 0); in a worker the worker's copy
            (``get_worker_info().dataset``) is read instead.
    """

    def __init__(self, collate_fn: Callable[[list[dict]], dict[str, Any]], stream: ExampleStream) -> None:
        self.collate_fn = collate_fn
        self.stream = stream

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        info = torch.utils.data.get_worker_info()
        stream = info.dataset if info is not None else self.stream
        epochs = [e.pop(EPOCH_FIELD, stream.epoch) for e in examples]
        batch = self.collate_fn([{**e, EPOCH_KEY: stream.epoch} for e in examples])
        batch[STREAM_KEY] = {"worker": stream.worker, "state": stream.state_dict()}
        batch[EPOCHS_KEY] = epochs
        return batch


class StreamLoader:
    """This process's batches of a stream, read by ``num_workers`` DataLoader workers, with an exact, resumable
    position (torchdata's ``StatefulDataLoader`` over an :class:`ExampleStream`).

    Each worker is one reader of the run (:mod:`~finetune.data.streams.plan`): it reads its share of every epoch,
    decodes, transforms and collates, ``prefetch_factor`` batches ahead; the loader takes one batch from each worker in
    turn. The stream is endless: an epoch's last batch of a reader is completed with the first examples of its next
    epoch, so nothing is dropped and the epochs' lengths need not divide by the batch.

    Position (:meth:`state_dict`, JSON): ``loader``, torchdata's state after the last batch yielded (each worker's
    :meth:`ExampleStream.state_dict` and which worker yields next); ``positions``, each reader's state at its last
    batch; ``reports``, the counts; the layout (``rank``, ``world_size``, ``num_workers``, ``readers``). On the same
    layout :meth:`load_state_dict` continues exactly; :meth:`load_states` re-splits what every process had left of the
    epochs in flight when the number of processes or workers changed.

    Args:
        stream: this process's stream.
        batch_size: examples per batch (the process's share of the global batch).
        collate_fn: examples -> batch.
        num_workers: the recipe's ``data.num_workers`` (0: read in this process).
        pin_memory: page-locked batches, for fast non-blocking copies to an accelerator.
        prefetch_factor: batches each worker prepares ahead.
        worker_init_fn: run in each worker as it starts (the training loop's makes workers ignore SIGINT / SIGTERM).
    """

    def __init__(self, stream: ExampleStream, *, batch_size: int, collate_fn: Callable[[list[dict]], dict[str, Any]],
                 num_workers: int = 0, pin_memory: bool = False, prefetch_factor: int = 2,
                 worker_init_fn: Callable[[int], None] | None = None) -> None:
        from torchdata.stateful_dataloader import StatefulDataLoader

        self.stream = stream
        self.spec = stream.spec
        self.num_workers = num_workers
        self.num_shards = stream.source.num_shards
        readers = stream.world_size * max(1, num_workers)
        if readers > stream.source.num_examples:
            raise DataError(
                f"data source {self.spec.name!r} has {stream.source.num_examples} samples for {readers} readers "
                f"({stream.world_size} processes x {max(1, num_workers)} data-loader workers): every reader needs one. "
                "Lower data.num_workers or add data")
        with warnings.catch_warnings():  # torchdata 0.11 on torch >= 2.10: "'set_vital' is deprecated"
            warnings.filterwarnings("ignore", message=".*set_vital.*")
            self.loader = StatefulDataLoader(
                stream, batch_size=batch_size, collate_fn=StreamCollate(collate_fn, stream), drop_last=True,
                num_workers=num_workers, pin_memory=pin_memory,
                prefetch_factor=prefetch_factor if num_workers else None, snapshot_every_n_steps=1,
                worker_init_fn=worker_init_fn if num_workers else None)
        #: the epoch of the reader of the last batch yielded
        self.epoch = 0
        self._positions: dict[str, dict[str, Any]] = {}
        self._carried: dict[str, Any] | None = None  # counts of a run resumed on another layout
        self._start: dict[str, Any] = {"epoch": 0, "shares": {}}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.loader:
            info = batch.pop(STREAM_KEY)
            self._positions[str(info["worker"])] = info["state"]
            self.epoch = info["state"]["epoch"]
            yield batch

    # -- state -------------------------------------------------------------------------------------
    def _layout(self) -> dict[str, int]:
        return {"rank": self.stream.rank, "world_size": self.stream.world_size, "num_workers": self.num_workers,
                "readers": self.stream.world_size * max(1, self.num_workers)}

    def state_dict(self) -> dict[str, Any]:
        """This process's position after the last batch yielded (JSON-serialisable; see the class)."""
        return {"version": _LOADER_STATE_VERSION, "name": self.spec.name, **self._layout(),
                "num_examples": self.stream.source.num_examples, "epoch": self.epoch, "positions": self._positions,
                "carried": self._carried, "start": self._start, "loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from this same process's :meth:`state_dict`, on the same layout (before iterating).

        Raises:
            DataError: saved with another layout (use :meth:`load_states`), or by an older xlipkit.
        """
        self._check_version(state)
        saved = {key: state.get(key) for key in self._layout()}
        if saved != self._layout():
            raise DataError(
                f"the checkpoint's stream position was saved by process {saved['rank']} of {saved['world_size']} with "
                f"{saved['num_workers']} data-loader worker(s), this is process {self.stream.rank} of "
                f"{self.stream.world_size} with {self.num_workers}: load every process's position (load_states) to "
                "re-split what is left")
        self.loader.load_state_dict(state["loader"])
        self._positions = {str(k): dict(v) for k, v in state["positions"].items()}
        self._carried = state.get("carried")
        self._start = state.get("start") or self._start
        self.epoch = int(state["epoch"])

    def _check_version(self, state: dict[str, Any]) -> None:
        if state.get("version") != _LOADER_STATE_VERSION or "positions" not in state:
            raise DataError(
                "the checkpoint's stream position was saved by an older xlipkit (a split by shards), which does not "
                "carry over to sample positions: resume with that version or start the run again")
        if state.get("num_examples") != self.stream.source.num_examples:
            raise DataError(
                f"the checkpoint's stream position counts {state.get('num_examples')} samples per epoch, data.train "
                f"now holds {self.stream.source.num_examples}: resume with the shards it was saved with")

    def load_states(self, states: list[dict[str, Any]]) -> bool:
        """Continue from every process's saved :meth:`state_dict` (``states[r]`` of process ``r`` of the saved run).
        The same layout: this process's own state (exact). Another number of processes or workers: what every old
        reader had left of each epoch in flight is pooled and split over the new readers by count
        (:func:`~finetune.data.streams.plan.remaining`, :func:`~finetune.data.streams.plan.split`); nothing is skipped
        or read twice, and the counts carry over. Returns True when the layout changed."""
        for state in states:
            self._check_version(state)
        if len(states) == self.stream.world_size and states[self.stream.rank].get("num_workers") == self.num_workers:
            self.load_state_dict(states[self.stream.rank])
            return False
        old = _old_readers(states)
        block, total = self.spec.shuffle_buffer, self.stream.source.num_examples
        left = remaining(old, block, self.spec.seed, total)
        readers = self._layout()["readers"]
        parts = {epoch: split(intervals, readers) for epoch, intervals in left.items()}
        shares = {str(k): {str(e): parts[e][k] for e in parts} for k in range(readers)}
        start = min(left)
        self.stream.assign(start, shares)
        self._start = {"epoch": start, "shares": shares}
        self._positions = {}
        self._carried = _summed(states) if self.stream.rank == 0 else None
        self.epoch = start
        left_now = sum(b - a for a, b in left[start])
        logger.warning(
            "train.resume: the stream was saved by %d process(es) x %d worker(s) and continues on %d x %d: the %d "
            "samples left of epoch %d are split again over %d readers (nothing skipped or read twice; the batches "
            "differ from those of an uninterrupted run)", len(states), max(1, states[0]["num_workers"]),
            self.stream.world_size, max(1, self.num_workers), left_now, start, readers)
        return True

    def report(self) -> dict[str, Any]:
        """This process's counts summed over its workers (as of the last batch yielded; with what a run resumed on
        another layout carried over): ``read``, ``used``, ``skipped``, the first ``skipped_examples``, the broken
        shards, ``epoch`` (epochs every reader of this process finished) and ``num_workers``."""
        reports = [_report(p) for p in self._positions.values()] or [self.stream.report()]
        epoch = min(r["epoch"] for r in reports) if self._positions else self.epoch
        if self._carried:
            reports.append(self._carried)
        out = {key: sum(r.get(key, 0) for r in reports) for key in _COUNTS}
        return {"epoch": epoch, **out,
                "skipped_examples": [e for r in reports for e in r["skipped_examples"]][:_SKIPPED_KEPT],
                "skipped_shards": _unique_shards(e for r in reports for e in r.get("skipped_shards", [])),
                "num_workers": self.num_workers}

    def preview(self) -> list[dict[str, Any]]:
        """The first examples of this process's stream (``stream.keep`` of them, with ``transform`` applied), for the
        report: those the training process read itself or, when workers read the stream, the first examples of this
        process's first reader's share of epoch 0, read again here (examples the workers trained on)."""
        if self.stream.preview:
            return list(self.stream.preview)
        s = self.stream
        fresh = ExampleStream(s.source, s.spec, on_error="skip", transform=s.transform, rank=s.rank,
                              world_size=s.world_size, keep=s.keep)
        fresh.shares = {"0": fresh_share_of(s, self.num_workers)}
        out = []
        for example in fresh:
            example.pop(EPOCH_FIELD, None)
            out.append(example)
            if len(out) >= s.keep:
                break
        return out


def fresh_share_of(stream: ExampleStream, num_workers: int) -> list[tuple[int, int]]:
    """Epoch 0's share of this process's first reader (worker 0)."""
    from finetune.data.streams.plan import fresh_share

    readers = stream.world_size * max(1, num_workers)
    return fresh_share(stream.source.num_examples, readers, stream.rank * max(1, num_workers), 0)


def _report(state: dict[str, Any]) -> dict[str, Any]:
    return {"epoch": state.get("finished", state["epoch"]), "read": state["read"], "used": state["yielded"],
            "skipped": state["skipped"],
            "skipped_examples": state["skipped_examples"], "skipped_shard_count": state.get("skipped_shard_count", 0),
            "skipped_shards": state.get("skipped_shards", [])}


def _old_readers(states: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every reader of a saved run, with its position (a reader that gave no batch yet: at the start it was given)."""
    readers = states[0]["readers"]
    if any(s["readers"] != readers for s in states) or readers != len(states) * max(1, states[0]["num_workers"]):
        raise DataError("the checkpoint's stream positions disagree on the number of readers (a damaged checkpoint); "
                        "resume from another checkpoint")
    found: dict[int, dict[str, Any]] = {}
    for state in states:
        for position in state["positions"].values():
            if position.get("version") != STATE_VERSION:
                raise DataError("a reader's stream position in the checkpoint was saved by an older xlipkit")
            found[int(position["reader"])] = position
    start = states[0].get("start") or {"epoch": 0, "shares": {}}
    out = []
    for k in range(readers):
        if k in found:
            out.append(found[k])
        else:
            out.append({"reader": k, "readers": readers, "epoch": start["epoch"], "done": 0,
                        "shares": (start.get("shares") or {}).get(str(k), {})})
    return out


def _summed(states: list[dict[str, Any]]) -> dict[str, Any]:
    """The counts of every reader of a saved run (and what it carried itself), as one report."""
    reports = [_report(p) for s in states for p in s["positions"].values()]
    reports += [s["carried"] for s in states if s.get("carried")]
    out = {key: sum(r.get(key, 0) for r in reports) for key in _COUNTS}
    return {**out, "epoch": 0, "skipped_examples": [e for r in reports for e in r["skipped_examples"]][:_SKIPPED_KEPT],
            "skipped_shards": _unique_shards(e for r in reports for e in r.get("skipped_shards", []))}
