"""Checkpoints (DESIGN 6): ``accelerator.save_state`` every ``train.checkpoint_every`` steps into
``checkpoints/step-N``, written atomically (a temporary folder, then a rename), with the loop's own state
(:class:`TrainState`) and a manifest of every file; the newest ``train.keep_checkpoints`` kept. A failed write
(a full disk above all) is diagnosed (:func:`describe_save_failure`) and raised as :class:`SaveFailedError`
on every process, the earlier checkpoints kept. The loop's checkpoints, written and resumed from, are
:class:`Checkpoints`; reading them (the listing, the manifest, integrity, the stream positions) and finding the one a
resume continues from are :mod:`finetune.runs.checkpoints` and :mod:`finetune.runs.resume`."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

import torch
from accelerate.utils import broadcast_object_list, gather_object, set_seed
from safetensors import SafetensorError

from finetune.config import Recipe, recipe_to_dict
from finetune.files import apply_umask, process_tag, replace_dir
from finetune.runs.checkpoints import (CHECKPOINT_PREFIX, STATE_NAME, STREAM_INDEX, checkpoint_step, file_manifest,
                                      list_checkpoints, read_stream_states, rng_problem, rng_state_name,
                                      stream_state_file)
from finetune.runs.identity import continuation_view
from finetune.runs.resume import check_continuation, find_checkpoint
from finetune.runs.space import folder_bytes, size_text
from finetune.training.signals import TrainingStopped

log = logging.getLogger("xlipkit")

__all__ = ["Checkpoints", "SaveFailedError", "TrainState", "describe_save_failure", "is_write_error",
           "save_checkpoint"]


@dataclass
class TrainState:
    """What a checkpoint stores beside accelerate's state (as JSON): the step and the loss history."""

    step: int = 0
    skipped_steps: int = 0
    samples_seen: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    #: per-term sums and counts over the steps since the last history entry (an entry holds the interval's
    #: mean, as transformers' Trainer logs its loss); kept here so a resumed run logs what a straight one does
    interval_sums: dict[str, float] = field(default_factory=dict)
    interval_counts: dict[str, int] = field(default_factory=dict)
    #: every logged value of the last finished step
    last_values: dict[str, float] = field(default_factory=dict)
    skipped_examples: list[dict[str, str]] = field(default_factory=list)
    #: seconds spent training up to ``step`` (over every resumed part)
    train_time_s: float = 0.0
    #: the recipe's continuation view (``finetune.runs.identity.continuation_view``), checked on resume
    recipe: dict[str, Any] | None = None
    #: ``{file: {"bytes": size, "sha256": hex}}`` of the checkpoint beside this state, checked on resume
    files: dict[str, Any] = field(default_factory=dict)
    #: FLOPs of one step on one process (counted at step 1, :func:`finetune.training.throughput.count_flops`)
    flops_per_step: int | None = None
    #: what each epoch read so far, every process's (:class:`finetune.training.epochs.EpochLedger`)
    epochs: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    def add_to_interval(self, sums: dict[str, float], counts: dict[str, int]) -> None:
        """Add each term's sum over ``counts[term]`` applied steps to the running sums of the current logging
        interval (host-side, here, so that checkpoints carry them)."""
        for key, value in sums.items():
            self.interval_sums[key] = self.interval_sums.get(key, 0.0) + value
            self.interval_counts[key] = self.interval_counts.get(key, 0) + counts[key]

    def close_interval(self, values: dict[str, float]) -> dict[str, float]:
        """The history entry of a logging step: each loss term's mean over the steps since the last entry (every
        step counts, not one in ``log_every``), the learning rate and logit scale of this step (``values``);
        starts the next interval."""
        sums, counts = self.interval_sums, self.interval_counts
        entry = {key: sums[key] / counts[key] if counts.get(key) else value for key, value in values.items()}
        self.interval_sums, self.interval_counts = {}, {}
        return entry

    @classmethod
    def from_json(cls, text: str) -> "TrainState":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in json.loads(text).items() if k in known})

    def load(self, saved: "TrainState") -> None:
        """Take every value of ``saved`` (a resume), in place: the loop's parts share this one state."""
        for f in fields(self):
            setattr(self, f.name, getattr(saved, f.name))


class SaveFailedError(RuntimeError):
    """A checkpoint (or ``final/``) could not be written: the disk is full, or another I/O error. The message says
    how much was needed and free, where, and what was kept; :func:`finetune.training.run_recipe` prints it and
    ends with status 1.

    Attributes:
        kept: the newest complete checkpoint (None when there is none).
        disk_full: whether the disk (or quota) ran out.
    """

    def __init__(self, message: str, *, kept: Path | None = None, disk_full: bool = False) -> None:
        super().__init__(message)
        self.kept = kept
        self.disk_full = disk_full


_WRITER_WORDS = ("inline_container", "PytorchStreamWriter", "file write failed")
#: how the writers that name no errno (safetensors, tokenizers: Rust ``io::Error``) say that the disk is full
_FULL_WORDS = ("No space left on device", "StorageFull", "Disk quota exceeded", "os error 28", "os error 122")


def is_write_error(error: BaseException) -> bool:
    """Whether ``error`` is a failed write: an ``OSError``, safetensors' ``SafetensorError``, torch's zip writer's
    ``RuntimeError``, or any error that says the disk is full (the tokenizers library raises a bare ``Exception``:
    ``No space left on device (os error 28)``)."""
    if isinstance(error, (OSError, SafetensorError)):
        return True
    text = str(error)
    if any(words in text for words in _FULL_WORDS):
        return True
    return isinstance(error, RuntimeError) and any(words in text for words in _WRITER_WORDS)


def _mount_point(path: Path) -> Path:
    path = path.resolve()
    while not path.exists() or not os.path.ismount(path):
        if path.parent == path:
            break
        path = path.parent
    return path


def describe_save_failure(error: BaseException, folder: Path, need: int | None) -> tuple[str, bool]:
    """``(why, disk_full)`` for a failed write into ``folder`` of about ``need`` bytes: a full disk (``ENOSPC`` or
    ``EDQUOT`` anywhere in the exception chain, the words of torch's and safetensors' writers, or a torch zip
    writer error while the disk has less free space than the save needs) is said so, with how much was needed,
    how much is free and on which file system; any other error is named as it is."""
    chain, seen = [], error
    while seen is not None and seen not in chain:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    text = " ".join(f"{type(e).__name__}: {e}" for e in chain)
    existing = folder
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    full = any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in chain) or any(
        words in text for words in _FULL_WORDS)
    if not full and need is not None and free < need and any(words in text for words in _WRITER_WORDS):
        full = True  # torch's zip writer names no errno; it fails so when the data no longer fits
    if full:
        needed = f"about {size_text(need)} are needed, " if need else ""
        return (f"the disk is full ({needed}{size_text(free)} free now in {existing}, on the file system mounted at "
                f"{_mount_point(existing)})", True)
    first = chain[-1] if chain else error
    return f"{type(first).__name__}: {first}".splitlines()[0], False


def _agree(accelerator: Any, failure: str | None) -> str | None:
    """The first failure any process reports (every process gets the same answer; a collective, so every process
    calls it at the same point)."""
    if accelerator.num_processes == 1:
        return failure
    return next((f for f in gather_object([failure]) if f), None)


def save_checkpoint(
    accelerator: Any, ckpt_dir: Path, state: TrainState, keep: int, stream_state: dict | None = None, *,
    need_bytes: Callable[[], int] | None = None, stream_index: dict | None = None,
) -> Path:
    """``accelerator.save_state`` into a temporary folder, then an atomic rename to ``step-N``; the older
    checkpoints beyond the last ``keep`` (and any of a later step, left by the trajectory a resume from an
    earlier checkpoint abandoned) are removed only once the new one is complete.

    The temporary folder is ``step-N.<PID@HOST>.tmp`` (the main process's :func:`finetune.files.process_tag`:
    a later run removes it only once that process is gone). ``stream_state``: this process's stream position
    (``StreamLoader.state_dict()``), written by each process as ``stream_state_<rank>.json``; every other file is
    written by accelerate (the main process for shared files, each process its ``random_states_<rank>.pkl``), so
    on a filesystem shared by several nodes each file has one writer. The main process then records the size and
    sha256 of every file (:func:`finetune.runs.checkpoints.file_manifest`) in ``train_state.json``, gives the files the
    user's umask (safetensors writes ``0600``) and renames the folder. ``stream_index``: the stream's shard index,
    written by the main process as :data:`STREAM_INDEX`.

    Raises:
        SaveFailedError: a write failed on some process (every process raises it): the temporary folder is
            removed, the earlier checkpoints are kept, and the message says why (a full disk: how much was
            needed and is free, where) and which checkpoint is the newest complete one.
    """
    main = accelerator.is_main_process
    final = ckpt_dir / f"{CHECKPOINT_PREFIX}{state.step}"
    name = f"{CHECKPOINT_PREFIX}{state.step}.{process_tag()}.tmp"
    if accelerator.num_processes > 1:
        name = broadcast_object_list([name])[0]  # the main process's tag
    tmp = ckpt_dir / name

    def begin() -> None:
        if main:
            ckpt_dir.mkdir(parents=True, exist_ok=True)

    def write_state() -> None:
        accelerator.save_state(str(tmp))
        if stream_state is not None:
            stream_state_file(tmp, accelerator.process_index).write_text(json.dumps(stream_state))
        if stream_index is not None and main:
            (tmp / STREAM_INDEX).write_text(json.dumps(stream_index))

    def finish() -> None:
        if main:
            state.files = file_manifest(tmp)
            (tmp / STATE_NAME).write_text(state.to_json())
            apply_umask(tmp)
            replace_dir(tmp, final)

    failure = None
    for write in (begin, write_state, finish):
        failure = _agree(accelerator, _attempt(write, accelerator, final, lambda: _need(ckpt_dir, need_bytes)))
        if failure:  # _agree is also the barrier between the phases
            break
    if failure:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise _save_failed(ckpt_dir, final, failure)
    if main:
        _remove_superseded(ckpt_dir, state.step, keep)
    accelerator.wait_for_everyone()
    return final


def _need(ckpt_dir: Path, need_bytes: Callable[[], int] | None) -> int | None:
    """About how many bytes a checkpoint takes: the newest one's size, or ``need_bytes()``, the larger."""
    previous = list_checkpoints(ckpt_dir)
    sizes = [folder_bytes(previous[-1])] if previous else []
    if need_bytes is not None:
        sizes.append(need_bytes())
    return max(sizes) if sizes else None


def _attempt(write: Callable[[], None], accelerator: Any, final: Path, need: Callable[[], int | None]) -> str | None:
    """Run one phase of a save; why it failed (:func:`describe_save_failure`), or None."""
    try:
        write()
    except Exception as error:  # noqa: BLE001 - every process must learn of it, or the others wait forever
        if not is_write_error(error):
            log.error("saving checkpoint %s failed on process %d", final.name, accelerator.process_index,
                      exc_info=True)
        why, _ = describe_save_failure(error, final.parent, need())
        return why
    return None


def _save_failed(ckpt_dir: Path, final: Path, failure: str) -> SaveFailedError:
    """The error of a checkpoint that could not be written, naming the newest complete one."""
    kept = list_checkpoints(ckpt_dir)
    last = kept[-1] if kept else None
    said = (f"the newest complete checkpoint, {last.parent.name}/{last.name}, is kept" if last is not None
            else "no earlier checkpoint exists")
    return SaveFailedError(f"checkpoint {final.name} could not be saved in {ckpt_dir}: {failure}; {said}",
                           kept=last, disk_full=failure.startswith("the disk is full"))


def _remove_superseded(ckpt_dir: Path, step: int, keep: int) -> None:
    """Remove the checkpoints past ``step`` (the trajectory a resume from an earlier or damaged one left:
    ``latest`` must not go back to them) and the older ones beyond the newest ``keep``."""
    for old in [p for p in list_checkpoints(ckpt_dir, complete=False) if checkpoint_step(p) > step]:
        log.info("removed %s: the run continued from an earlier checkpoint", old)
        shutil.rmtree(old, ignore_errors=True)
    for old in list_checkpoints(ckpt_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


class Checkpoints:
    """The loop's checkpoints: written at ``train.checkpoint_every`` steps and when a signal stops the run
    (:meth:`save`, :meth:`stopped`), resumed from (:meth:`resume`).

    Args:
        accelerator: the run's ``accelerate.Accelerator`` (its prepared objects are what is saved and loaded).
        run_dir: the run folder (``checkpoints/`` goes inside).
        state: the loop's state, saved beside accelerate's and loaded in place on resume.
        cfg: the recipe's ``train`` section (``keep_checkpoints``, ``seed``, ``resume_ignore_rng``).
        epochs: what each epoch read, this process's (:class:`~finetune.training.epochs.EpochLedger`): saved merged
            over the processes, loaded on one process on resume.
        stream: the run's :class:`~finetune.data.streams.StreamLoader` (its position is saved), or None.
        sized: the tensors a checkpoint holds (the module's state and the optimiser's), for the room it needs.
    """

    def __init__(self, accelerator: Any, run_dir: str | Path, state: TrainState, cfg: Any, epochs: Any, *,
                 stream: Any = None, sized: Callable[[], list[torch.Tensor]] = list) -> None:
        self.accelerator, self.state, self.cfg, self.epochs = accelerator, state, cfg, epochs
        self.stream, self.sized = stream, sized
        self.ckpt_dir = Path(run_dir) / "checkpoints"

    def save(self, clock: Any) -> Path:
        """A checkpoint of the current step; the time spent saving is left out of the throughput (``clock``, a
        :class:`~finetune.training.throughput.LoopClock`).

        Raises:
            SaveFailedError: it could not be written (the earlier ones are kept).
        """
        saving = time.perf_counter()
        self.state.train_time_s = clock.trained_s()
        self.state.epochs = self.epochs.merged(self.accelerator)
        stream_state = self.stream.state_dict() if self.stream is not None else None
        index = self.stream.stream.source.index.to_json() if self.stream is not None else None
        path = save_checkpoint(self.accelerator, self.ckpt_dir, self.state, self.cfg.keep_checkpoints, stream_state,
                               need_bytes=self.bytes_needed, stream_index=index)
        clock.excluded_s += time.perf_counter() - saving
        return path

    def stopped(self, signum: int, step: int, clock: Any) -> TrainingStopped:
        """The :class:`TrainingStopped` of a run a signal stops after ``step``, once this step's checkpoint is saved
        (none when the save failed: the error says why)."""
        try:
            return TrainingStopped(signum, step, self.save(clock))
        except SaveFailedError as error:
            return TrainingStopped(signum, step, None, str(error))

    def bytes_needed(self) -> int:
        """About what one checkpoint takes: the model's and objective's tensors and the optimiser's state."""
        return sum(t.numel() * t.element_size() for t in self.sized())

    def resume(self, resume: str | None, *, checkpoint: str | Path | None = None, recipe: Recipe | None = None,
               ignore_changes: bool = False, ignore_rng: bool | None = None) -> bool:
        """Continue from ``train.resume`` (``latest`` or a checkpoint folder); True when resumed.

        Args:
            resume: the recipe's ``train.resume``.
            checkpoint: the folder already found by :func:`finetune.runs.resume.find_checkpoint` (skips the search).
            recipe: the run's recipe: its continuation view (:func:`finetune.runs.identity.continuation_view`) is
                saved in every checkpoint and compared with the checkpoint's on resume.
            ignore_changes: ``train.resume_ignore_changes``: continue despite a different recipe.
            ignore_rng: ``train.resume_ignore_rng`` (None: the recipe's): resume from a checkpoint whose RNG state
                is missing or damaged, with a fresh one seeded from ``train.seed`` and the step.

        Raises:
            finetune.runs.errors.CheckpointError: no usable checkpoint at a given path (names the file).
            finetune.runs.errors.RunFolderError: the checkpoint was saved with a different recipe.
        """
        acc = self.accelerator
        view = continuation_view(recipe_to_dict(recipe)) if recipe is not None else None
        self.state.recipe = view
        if ignore_rng is None:
            ignore_rng = bool(getattr(self.cfg, "resume_ignore_rng", False))
        path = Path(checkpoint) if checkpoint is not None else find_checkpoint(
            resume, self.ckpt_dir, world_size=acc.num_processes, ignore_rng=ignore_rng)
        if path is None:
            return False
        saved = TrainState.from_json((path / STATE_NAME).read_text())
        check_continuation(saved.recipe, view, path, ignore_changes=ignore_changes)
        rng_missing = rng_problem(path, acc.process_index) if ignore_rng else None
        if rng_missing is None and not (path / rng_state_name(acc.process_index)).is_file():
            rng_missing = (f"the checkpoint was saved by fewer processes (no "
                           f"{rng_state_name(acc.process_index)}): a requeue on another number of processes")
        acc.load_state(str(path))
        if rng_missing:  # accelerate skipped (or loaded a damaged) RNG state: a fresh one, reproducible from the step
            set_seed(self.cfg.seed + saved.step + 1_000_003 * acc.process_index)
            log.warning("train.resume_ignore_rng: %s; process %d continues with a fresh RNG state seeded from "
                        "train.seed and step %d", rng_missing, acc.process_index, saved.step)
        if view is None:
            view = saved.recipe
        self.state.load(saved)
        self.state.recipe = view
        self.epochs.load(saved.epochs if acc.is_main_process else [])  # on one process: merged sums them
        if self.stream is not None:
            self.stream.load_states(read_stream_states(path))
        log.info("resumed from %s at step %d", path, self.state.step)
        return True
