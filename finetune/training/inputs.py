"""What a run reads: its sets, loaded and checked before the model loads (:func:`load_data`), the checkpoint it
resumes from (:func:`find_resume`), the rows it trains on after the objective's preprocessing
(:func:`training_set`) or its stream (:func:`open_train_stream`), and what the stream read (:func:`stream_report`)."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

from accelerate.utils import broadcast_object_list, gather_object

from finetune.config import Recipe
from finetune.data.images import DEFAULT_MAX_IMAGE_PIXELS, DataError, set_max_image_pixels
from finetune.data.skipping import drop_undecodable
from finetune.data.sources import load_source
from finetune.data.streams import (ExampleStream, ShardIndex, check_stream_columns, check_stream_shards, open_stream,
                                   shard_layout)
from finetune.data.streams.index import changed_shards
from finetune.data.streams.source import stream_shards
from finetune.data.streams.urls import DEFAULT_READ_TIMEOUT_S, ReadPolicy, storage_options
from finetune.evaluation import set_label
from finetune.objectives import Objective, Term
from finetune.runs.checkpoints import read_stream_index
from finetune.runs.errors import CheckpointError
from finetune.runs.resume import find_checkpoint
from finetune.training.context import RunData, TrainingSet
from finetune.training.distributed import resume_problem

log = logging.getLogger("xlipkit")

__all__ = ["find_resume", "load_data", "open_train_stream", "preprocesses", "read_policy", "stream_report",
           "training_set"]


def read_policy(recipe: Recipe) -> ReadPolicy:
    """How the recipe's stream may be read: ``pipe:`` commands only when the user allowed the recipe's code on the
    command line (``Recipe.trust_code``, never a recipe key), remote reads bounded by ``data.read_timeout_s``."""
    return ReadPolicy(commands=bool(getattr(recipe, "trust_code", False)),
                      timeout_s=float(getattr(recipe.data, "read_timeout_s", DEFAULT_READ_TIMEOUT_S)))


def load_data(recipe: Recipe, accelerator: Any) -> RunData:
    """Load and validate the training set and every evaluation set (and find the resume checkpoint) before the
    model loads or anything is written; errors name the set. A streamed ``data.train`` is opened by the loop: its
    shards and columns are checked here, on every process (its own shards).

    Raises:
        DataError: a set that cannot be loaded (unknown name, missing files, bad examples with
            ``data.on_error: raise``).
        CheckpointError: a ``train.resume`` that names no usable checkpoint.
    """
    resume = find_resume(recipe, accelerator)
    set_max_image_pixels(getattr(recipe.data, "max_image_pixels", DEFAULT_MAX_IMAGE_PIXELS))
    options = dict(on_error=recipe.data.on_error, cache_dir=recipe.data.cache_dir,
                   validate=getattr(recipe.data, "validate", "header"))
    train, index = None, None
    if recipe.data.train.is_stream:  # a typed SourceSpec since load_recipe
        try:
            policy = read_policy(recipe)
            check_stream_shards(recipe.data.train, accelerator.num_processes, policy)
            index = stream_index(recipe, accelerator, resume)
            source = open_stream(recipe.data.train, rank=accelerator.process_index,
                                 world_size=accelerator.num_processes, index=index, policy=policy)
            check_stream_columns(recipe.data.train, source=source)
            check_broken_shards(source, recipe.data.on_error)
            readers = accelerator.num_processes * max(1, recipe.data.num_workers)
            if source.num_examples < readers:
                raise DataError(f"its {source.num_examples} samples cannot give each of the {readers} readers "
                                f"({accelerator.num_processes} processes x data.num_workers={recipe.data.num_workers}) "
                                "one: lower data.num_workers or add data")
        except DataError as exc:
            raise DataError(f"training set (data.train): {exc}") from exc
    else:
        with accelerator.main_process_first():
            try:
                train = load_source(recipe.data.train, **options)
            except (DataError, OSError) as exc:
                raise DataError(f"training set (data.train) could not be loaded: {exc}") from exc
    sets = []
    ev = recipe.eval
    if ev.sets and (ev.before or ev.after or ev.compare_base_length):
        for spec in ev.sets:
            with accelerator.main_process_first():
                try:
                    sets.append(load_source(spec, **options))
                except (DataError, OSError) as exc:
                    raise DataError(f"evaluation set {set_label(spec)!r} (eval.sets) could not be loaded: "
                                    f"{exc}") from exc
    return RunData(train=train, eval=sets, resume=resume, stream_index=index)


def stream_index(recipe: Recipe, accelerator: Any, resume: Path | None) -> ShardIndex:
    """The streamed ``data.train``'s shard index (sample counts), the same on every process: the one the resumed
    checkpoint saved (its positions count on it; its shards checked unchanged, :func:`resumed_index`), else
    ``options.index``, else counted once by the main process (:func:`finetune.data.streams.build_index`) and told to
    the others.

    Raises:
        DataError: on every process, when the main process could not count (naming the shard), or a shard changed
            since the checkpoint was saved.
    """
    spec = recipe.data.train
    found, error = None, None
    if accelerator.is_main_process:
        try:
            saved = read_stream_index(resume) if resume is not None else None
            if saved is not None:
                found = resumed_index(recipe, saved, resume)
            else:
                found = open_stream(spec, policy=read_policy(recipe)).index
        except DataError as exc:
            error = str(exc)
    if accelerator.num_processes > 1:
        found, error = broadcast_object_list([found, error])
    if error:
        raise DataError(error)
    return found


def resumed_index(recipe: Recipe, saved: dict[str, Any], resume: Path) -> ShardIndex:
    """The shard index a checkpoint saved, over ``data.train``'s shards, after checking that they are the shards it
    was saved reading: the same urls, and the same content where the index recorded what identifies it (each shard's
    size and the digest of its first bytes, :func:`~finetune.data.streams.index.fingerprint`). A shard rewritten
    with the same number of samples would otherwise be read at the saved positions as if it were the old one.

    Raises:
        DataError: other shards, or a changed shard (naming it) unless ``train.resume_ignore_changes``.
    """
    spec = recipe.data.train
    kind, urls = stream_shards(spec)
    found = ShardIndex.from_json(saved, kind, where=f"{resume}/stream_index.json")
    if not found.matches(urls):
        raise DataError(f"train.resume: the checkpoint {resume} was saved reading other shards than "
                        "data.train's; resume with the shards it was saved with")
    found = found.for_urls(urls)
    changed = changed_shards(found, storage_options(spec), read_policy(recipe), name=spec.name)
    if changed:
        listed = "; ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
        if not recipe.train.resume_ignore_changes:
            raise DataError(
                f"train.resume: {len(changed)} shard(s) of data.train changed since the checkpoint {resume} was saved "
                f"({listed}): its positions would now read other samples than the run trained on. Resume with the "
                "shards it was saved with, or set train.resume_ignore_changes: true to continue on the new data")
        log.warning("train.resume_ignore_changes: %d shard(s) changed since the checkpoint was saved (%s); the run "
                    "continues at its saved positions in the new data", len(changed), listed)
    return found


def check_broken_shards(source: Any, on_error: str) -> None:
    """Tar shards that end early, found when they were counted: named in a warning (``data.on_error: skip``: the
    rest of each is skipped and counted every epoch), or a DataError before the model loads (``raise``)."""
    broken = source.index.broken
    if not broken:
        return
    listed = "; ".join(f"{url}: {why}" for url, why in list(broken.items())[:5])
    if on_error == "raise":
        raise DataError(f"{len(broken)} shard(s) cannot be read to their end ({listed}): they are truncated or "
                        "damaged. Replace or remove them, or set data.on_error: skip to skip the rest of a broken "
                        "shard (counted in metrics.json)")
    log.warning("data.train: %d shard(s) end early and their rest is skipped every epoch (data.on_error: skip): %s",
                len(broken), listed)


def find_resume(recipe: Recipe, accelerator: Any) -> Path | None:
    """The checkpoint ``train.resume`` names (:func:`finetune.runs.resume.find_checkpoint`: every file's sha256 checked,
    ``latest`` falling back past damaged ones), found by the main process and told to the others, so that the
    files are read once.

    Raises:
        CheckpointError: on every process, naming the file; or the checkpoint is another engine's, or DeepSpeed's
            from another number of processes (:func:`~finetune.training.distributed.resume_problem`).
    """
    t = recipe.train
    found, error = None, None
    if accelerator.is_main_process:
        try:
            found = find_checkpoint(t.resume, Path(recipe.output.dir) / "checkpoints",
                                    world_size=accelerator.num_processes,
                                    ignore_rng=bool(getattr(t, "resume_ignore_rng", False)))
        except CheckpointError as exc:
            error = str(exc)
        if found is not None:  # the engine that wrote it, and DeepSpeed's process count
            error = resume_problem(found, accelerator)
    if accelerator.num_processes > 1:
        found, error = broadcast_object_list([found, error])
    if error:
        raise CheckpointError(error)
    return found


def training_set(recipe: Recipe, source: Any, objective: Objective, model: Any, accelerator: Any,
                 index: ShardIndex | None = None) -> TrainingSet:
    """The rows the loop trains on: ``data.train`` (``source``, as loaded) after the objective's preprocessing,
    computed once by the main process and reused from the cache by the others; images that do not decode are
    dropped first when a term preprocesses the whole set (it decodes every image). A stream is opened instead
    (``source`` None)."""
    if source is None:
        return TrainingSet(open_train_stream(recipe, objective, model, accelerator, index))
    _log_skips("train", source)
    with accelerator.main_process_first():  # cached preprocessing: computed once, then reused by the others
        rows = source.dataset
        if preprocesses(objective):  # it decodes every image: bad ones must not reach it
            rows, dropped = drop_undecodable(rows, on_error=recipe.data.on_error, cache_dir=recipe.data.cache_dir)
            if dropped:
                source.skipped += len(dropped)
                source.skipped_examples.extend(dropped)
                source.skipped_ids.extend(e["id"] for e in dropped)
                log.warning("train set: skipped %d images that do not decode before preprocessing (first: %s)",
                            len(dropped), ", ".join(e["id"] for e in dropped[:5]))
        rows = objective.preprocess(rows, model, cache_dir=recipe.data.cache_dir, log=log)
    return TrainingSet(rows, source)


def open_train_stream(recipe: Recipe, objective: Objective, model: Any, accelerator: Any,
                      index: ShardIndex | None = None) -> ExampleStream:
    """``data.train`` as this process's :class:`~finetune.data.streams.ExampleStream` (over ``index``, the run's
    shard index), the objective's per-example work (``stream_map``) run on every example."""
    spec = recipe.data.train
    rank, world = accelerator.process_index, accelerator.num_processes
    raw = open_stream(spec, rank=rank, world_size=world, index=index, policy=read_policy(recipe))
    per_epoch = raw.num_examples / recipe.train.batch_size
    log.info("training on a stream: %s, %s; an epoch is %.1f steps of train.batch_size=%d, %d steps in all",
             spec.name, shard_layout(raw.num_shards, world, recipe.data.num_workers, raw.num_examples), per_epoch,
             recipe.train.batch_size, recipe.train.max_steps)
    if spec.shuffle_buffer > 1:
        log.info("data.train.shuffle_buffer=%d: each reader gives its share in shuffled blocks of %d samples; a resume "
                 "reads the current block again (at most %d samples per reader) and is exact", spec.shuffle_buffer,
                 spec.shuffle_buffer, spec.shuffle_buffer)
    return ExampleStream(raw, spec, on_error=recipe.data.on_error, rank=rank, world_size=world,
                         transform=functools.partial(objective.stream_map, model=model))


def stream_report(loader: Any, accelerator: Any, epoch: int | None = None) -> dict:
    """The streams' counts summed over processes and their data-loader workers: examples ``read``, ``used``,
    ``skipped`` (and the first skipped ones), broken webdataset shards whose rest was skipped
    (``skipped_shard_count``, each time; ``skipped_shards``, the first few with why), the global ``epoch`` (the epochs
    read whole: ``epoch`` when given, the progress bar's epoch rounded down; else the epochs every reader of every
    process moved past, which lags by one when the run stopped just at an epoch's end), ``num_processes``,
    ``num_workers`` (of process 0)."""
    reports = gather_object([loader.report()]) if accelerator.num_processes > 1 else [loader.report()]
    skipped_examples = [e for r in reports for e in r["skipped_examples"]][:5]
    skipped = sum(r["skipped"] for r in reports)
    if skipped:
        log.warning("train stream %s: skipped %d unreadable examples (first: %s)", loader.spec.name, skipped,
                    ", ".join(str(e["id"]) for e in skipped_examples))
    shards = list({e["shard"]: e for r in reports for e in r.get("skipped_shards", [])}.values())[:5]
    if epoch is None:
        epoch = min(r["epoch"] for r in reports)  # epochs every reader of every process moved past
    broken = sum(r.get("skipped_shard_count", 0) for r in reports)
    if broken:
        log.warning("train stream %s: skipped the rest of %d broken shard(s) %d time(s) in all: %s", loader.spec.name,
                    len(shards), broken, ", ".join(f"{e['shard']} ({e['reason']})" for e in shards))
    return {"format": loader.spec.name, "num_processes": len(reports), "num_workers": reports[0]["num_workers"],
            "epoch": epoch, "read": sum(r["read"] for r in reports),
            "used": sum(r["used"] for r in reports), "skipped": skipped, "skipped_examples": skipped_examples,
            "skipped_shard_count": broken, "skipped_shards": shards}


def preprocesses(objective: Objective) -> bool:
    """Whether a term of ``objective`` has a whole-dataset ``preprocess`` step (which decodes images)."""
    return any(type(t).preprocess is not Term.preprocess for t in objective.all_terms)


def _log_skips(role: str, src: Any) -> None:
    if src.skipped:
        ids = ", ".join(str(e.get("id")) for e in src.skipped_examples[:5])
        log.warning("%s set %s: skipped %d unreadable examples (first: %s)", role, src.name, src.skipped, ids)
