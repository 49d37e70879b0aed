"""The checks of a run's sizes, made once the data (and the model) are loaded and before training, each naming the
recipe key to change: a batch that does not split over the processes or a training set smaller than one batch
(:func:`check_batch`), a disk that cannot hold what the run will write (:func:`check_room`), and a warm-up as long as
the run (:func:`check_warmup`, a warning). What is checked before anything loads is
:func:`finetune.training.preflight.preflight`'s."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Any

from accelerate.utils import broadcast_object_list

from finetune.config import Recipe
from finetune.objectives import Objective
from finetune.runs.errors import RunFolderError
from finetune.runs.space import check_free_space, estimate_run_bytes, folder_bytes
from finetune.training.optim import warmup_problem

__all__ = ["check_batch", "check_room", "check_warmup"]

log = logging.getLogger("xlipkit")


def check_batch(recipe: Recipe, train: Any, num_processes: int, objective: Objective) -> None:
    """A training set smaller than one optimiser step, or a batch that does not split over the processes,
    is a recipe error found with the data, before the model loads or anything is written.

    Args:
        recipe: the run's recipe.
        train: ``data.train`` as loaded (a ``LoadedSource``), or None for a stream.
        num_processes: the processes of the launch.
        objective: the run's objective (it counts the examples: GRM trains on one per caption).

    Raises:
        RunFolderError: naming the keys to change.
    """
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
    the checkpoints kept at once (:func:`finetune.runs.space.estimate_run_bytes`), less an earlier
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
