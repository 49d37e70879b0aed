"""The checks a run makes before anything slow starts, each naming the recipe key to change: a streamed
``data.train`` the objective cannot train on (:func:`check_stream_recipe`), a batch too small for a contrastive
term (:func:`check_contrastive_batch`), a batch that does not split over the processes or a training set smaller
than one batch (:func:`check_batch`), and a disk that cannot hold what the run
will write (:func:`check_room`); and a warm-up as long as the run (:func:`check_warmup`, a warning)."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Any

from accelerate.utils import broadcast_object_list

from finetune.config import Recipe, RecipeError
from finetune.data.images import DataError
from finetune.data.sources import SourceSpec
from finetune.data.streams import STREAM_EXAMPLE_FIELDS, check_fields
from finetune.data.streams.urls import check_commands
from finetune.objectives import Objective
from finetune.run_folder import RunFolderError, check_free_space, estimate_run_bytes, folder_bytes
from finetune.training.inputs import read_policy
from finetune.training.optim import warmup_problem

__all__ = ["check_batch", "check_contrastive_batch", "check_room", "check_stream_recipe", "check_warmup"]

log = logging.getLogger("xlipkit")


def check_stream_recipe(recipe: Recipe, objective: Objective) -> None:
    """Recipe checks for a streamed ``data.train``, run before the model loads.

    Args:
        recipe: a loaded recipe (``data.train`` a typed ``SourceSpec``).
        objective: the run's objective, built from ``recipe.objective``
            (:func:`finetune.objectives.build_objective`).

    Raises:
        RecipeError: ``train.max_steps`` is null (a stream has no length to count epochs with), an
            objective term cannot run on streamed examples (naming the option that makes it streamable), a
            term reads an example field the stream does not pass through (``data.train.options.fields``), or a
            ``pipe:`` command runs without the user's ``--trust-recipe-code`` (``Recipe.trust_code``).
    """
    spec = recipe.data.train  # a typed SourceSpec, checked (streams included) by load_recipe
    if not spec.is_stream:
        return
    if recipe.train.max_steps is None:
        raise RecipeError(
            f"data.train is a stream ({spec.name}) whose length is unknown, so train.epochs cannot be counted: "
            "set train.max_steps (the number of optimiser steps)", key="train.max_steps")
    try:
        objective.check_stream()
    except ValueError as error:
        raise RecipeError(str(error), key="objective") from None
    _check_example_fields(spec, objective, recipe)
    try:  # a pipe: command the user did not allow: refused before anything runs, by validate as by train
        check_commands(spec, read_policy(recipe))
    except DataError as error:
        raise RecipeError(str(error), key="data.train.urls") from None


def _check_example_fields(spec: SourceSpec, objective: Any, recipe: Any) -> None:
    """A RecipeError when a term reads an example field (:meth:`~finetune.objectives.base.Term.example_fields`)
    that the stream does not pass through: without it the first batch would raise, after the evaluation."""
    try:
        fields = check_fields(spec)
    except DataError as error:
        raise RecipeError(f"data.train: {error}", key="data.train.options.fields") from None
    passed = {key.rpartition(".")[2] for key in fields} | STREAM_EXAMPLE_FIELDS
    missing: dict[str, list[str]] = {}
    for term in objective.all_terms:
        for name, key in term.example_fields().items():
            if name not in passed:
                missing.setdefault(key, []).append(name)
    if missing:
        key, names = next(iter(missing.items()))
        given = ", ".join(fields) or "none"
        where = f"{recipe.source}: " if getattr(recipe, "source", None) else ""
        raise RecipeError(
            f"{where}{key} reads {', '.join(names)} from every example, which data.train (a {spec.name} stream) does "
            f"not pass through (data.train.options.fields: {given}): add "
            f"{', '.join('json.' + n if spec.name == 'webdataset' else n for n in names)} to "
            f"data.train.options.fields (json.FIELD for a field of a webdataset KEY.json), or set {key}: null",
            file=getattr(recipe, "source", None), key="data.train.options.fields")


def check_contrastive_batch(recipe: Recipe, objective: Objective) -> None:
    """A ``train.batch_size`` that gives a contrastive term (``clip``, ``siglip``, ...) batches of one example, whose
    loss is exactly 0 at every step (:meth:`~finetune.objectives.Objective.check_batch`), is a recipe error found
    before anything slow (``xlipkit train`` and ``xlipkit validate`` call it with the objective built).

    Raises:
        RecipeError: naming ``train.batch_size``.
    """
    try:
        objective.check_batch(recipe.train.batch_size, recipe.train.accumulation_steps)
    except ValueError as exc:
        raise RecipeError(str(exc), key="train.batch_size") from None


def check_batch(recipe: Recipe, train: Any, num_processes: int, objective: Objective) -> None:
    """A training set smaller than one optimiser step, or a batch that does not split over the processes,
    is a recipe error found with the data, before the model loads or anything is written.

    Args:
        recipe: the run's recipe.
        train: ``data.train`` as loaded (a ``LoadedSource``), or None for a stream.
        num_processes: the processes of the launch.
        objective: the run's objective (it counts the examples: GRM trains on one per caption).

    Raises:
        RunFolderError: naming the keys to change; RecipeError: a batch too small for a contrastive term.
    """
    check_contrastive_batch(recipe, objective)
    t = recipe.train
    if t.batch_size % (num_processes * t.accumulation_steps):
        raise RunFolderError(f"train.batch_size={t.batch_size} must be divisible by processes x "
                             f"train.accumulation_steps = {num_processes} x {t.accumulation_steps}; change "
                             "train.batch_size or train.accumulation_steps")
    if train is None:
        return
    examples = objective.training_examples(train.dataset)  # GRM: one per caption
    if examples < t.batch_size:
        skipped = f" ({train.skipped} unreadable examples skipped)" if train.skipped else ""
        raise RunFolderError(f"the training set (data.train) has {examples} usable examples{skipped}, "
                             f"fewer than one batch (train.batch_size={t.batch_size}): lower train.batch_size or "
                             "add data")


def check_warmup(recipe: Recipe, train: Any, objective: Objective, main: bool) -> None:
    """A warm-up as long as the run or longer (:func:`finetune.training.optim.warmup_problem`) is a warning, logged
    once the step count is known (``train.max_steps``, or the epochs over the loaded training set) and before the
    model loads.

    Args:
        recipe: the run's recipe.
        train: ``data.train`` as loaded (a ``LoadedSource``), or None for a stream.
        objective: the run's objective (it counts the examples).
        main: whether this is the main process (the one that logs).
    """
    t = recipe.train
    if t.max_steps:
        total, how = t.max_steps, f"train.max_steps={t.max_steps}"
    elif train is not None:
        per_epoch = objective.training_examples(train.dataset) // t.batch_size
        total = t.epochs * per_epoch
        how = (f"train.epochs={t.epochs} x {per_epoch} steps per epoch of train.batch_size={t.batch_size}; "
               "train.max_steps is not set")
    else:
        return
    problem = warmup_problem(t, total, how)
    if problem and main:
        log.warning(problem)


def check_room(recipe: Recipe, model: Any, objective: Objective, train: Any, accelerator: Any) -> None:
    """Stop before training when ``output.dir``'s disk cannot hold what the run will write: ``final/`` and
    the checkpoints kept at once (:func:`finetune.run_folder.estimate_run_bytes`), less an earlier
    ``final/`` and checkpoints that the run replaces. The main process checks; every process gets its answer.

    Args:
        train: ``data.train`` as loaded, or None for a stream (``train.max_steps`` counts the steps).

    Raises:
        RunFolderError: how much is needed and free.
    """
    out_dir, t = Path(recipe.output.dir), recipe.train
    error = None
    if accelerator.is_main_process:
        tensors = itertools.chain(model.state_dict().values(), objective.state_dict().values())
        trained = [p for p in itertools.chain(model.parameters(), objective.parameters()) if p.requires_grad]
        steps = t.max_steps or (t.epochs * (len(train.dataset) // t.batch_size) if train is not None else 0)
        written = steps // t.checkpoint_every if t.checkpoint_every else 0
        estimate = estimate_run_bytes(
            model_bytes=sum(x.numel() * x.element_size() for x in tensors),
            trainable_bytes=sum(p.numel() * p.element_size() for p in trained),
            trainable_numel=sum(p.numel() for p in trained), full=recipe.adapter.type == "full",
            checkpoints_written=written, keep=t.keep_checkpoints)
        detail = f"final/ {estimate['final'] / 2**20:.1f} MiB"
        if estimate["checkpoints"]:
            detail += f" + {estimate['checkpoints']} checkpoints x {estimate['checkpoint'] / 2**20:.1f} MiB"
        try:
            check_free_space(out_dir, estimate["total"], what=f"output.dir {str(out_dir)!r}", detail=detail,
                             reclaimed=folder_bytes(out_dir / "final") + folder_bytes(out_dir / "checkpoints"))
        except RunFolderError as exc:
            error = str(exc)
    if accelerator.num_processes > 1:
        error = broadcast_object_list([error])[0]
    if error:
        raise RunFolderError(error)
