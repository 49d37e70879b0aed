"""Resume checks what it resumes (:func:`find_checkpoint`): the checkpoint ``train.resume`` names exists, every file
is there with the bytes it was saved with, the RNG state of every process can be restored
(:func:`finetune.runs.checkpoints.checkpoint_problem`), and it was written by the same run
(:func:`check_continuation`, over :func:`finetune.runs.identity.continuation_view`). ``train.resume: latest`` falls
back to the newest checkpoint that passes (saying which it skipped and why); a checkpoint named by its path must
pass.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from finetune.runs.checkpoints import CHECKPOINT_PREFIX, STATE_NAME, checkpoint_problem, list_checkpoints
from finetune.runs.errors import CheckpointError, RunFolderError
from finetune.runs.identity import differing_keys, with_added_defaults

__all__ = ["check_continuation", "find_checkpoint"]

log = logging.getLogger("xlipkit")


def find_checkpoint(resume: str | None, ckpt_dir: str | os.PathLike, *, world_size: int = 1,
                    ignore_rng: bool = False) -> Path | None:
    """The checkpoint ``train.resume`` names, checked with :func:`finetune.runs.checkpoints.checkpoint_problem` (every
    file's sha256).

    Args:
        resume: None (no resume), ``latest`` (the newest intact ``step-N`` in ``ckpt_dir``; a newer one that
            is incomplete or damaged is skipped with a warning that names the file and why) or a checkpoint
            folder.
        ckpt_dir: the run's ``checkpoints/`` folder.
        world_size: processes of this launch (each needs its RNG state).
        ignore_rng: ``train.resume_ignore_rng``.
    Returns:
        the folder, or None (no resume, or ``latest`` with no checkpoint yet: logged).
    Raises:
        CheckpointError: a path that is not an intact checkpoint, or ``latest`` when every checkpoint is
            unusable (naming the file of each).
    """
    if not resume:
        return None
    ckpt_dir = Path(ckpt_dir)
    check = dict(world_size=world_size, ignore_rng=ignore_rng)
    if resume == "latest":
        candidates = list_checkpoints(ckpt_dir, complete=False)
        if not candidates:
            log.info("train.resume: latest: no checkpoint in %s yet; training starts at step 0", ckpt_dir)
            return None
        problems = []
        for path in reversed(candidates):
            problem = checkpoint_problem(path, **check)
            if problem is None:
                for skipped, why in problems:
                    log.warning("train.resume: latest: skipped %s: %s; resuming from %s", skipped, why, path.name)
                return path
            problems.append((path.name, problem))
        raise CheckpointError(
            f"train.resume: latest: no usable checkpoint in {ckpt_dir}: "
            + "; ".join(f"{name}: {why}" for name, why in problems)
            + ". Remove the damaged checkpoints, or unset train.resume to start again")
    path = Path(resume).expanduser()
    if not path.is_dir():
        raise CheckpointError(
            f"train.resume: {resume} is not a checkpoint folder (it does not exist); use `latest` or a folder "
            f"like {ckpt_dir / (CHECKPOINT_PREFIX + '100')}")
    problem = checkpoint_problem(path, **check)
    if problem is not None:
        holds_checkpoints = not (path / STATE_NAME).exists() and list_checkpoints(path, complete=False)
        hint = "; its step-N folders are checkpoints" if holds_checkpoints else ""
        raise CheckpointError(f"train.resume: {resume} is not a checkpoint folder ({problem}){hint}")
    return path


def check_continuation(saved: dict[str, Any] | None, current: dict[str, Any] | None, checkpoint: Path, *,
                       ignore_changes: bool = False) -> None:
    """Compare the continuation view a checkpoint was saved with to the current recipe's.

    Raises:
        RunFolderError: listing the differing keys, unless ``ignore_changes`` (then logged).
    """
    if saved is None or current is None:
        return
    saved = with_added_defaults(saved, current)
    if saved == current:
        return
    changes = differing_keys(saved, current)
    if not ignore_changes:
        raise RunFolderError(
            f"train.resume: {checkpoint} was saved by a run with a different recipe; differing keys: "
            f"{'; '.join(changes)}. Resume with that run's recipe, or set train.resume_ignore_changes: true "
            "to continue with these changes on purpose")
    log.warning("train.resume_ignore_changes: continuing %s with changed keys: %s", checkpoint, "; ".join(changes))
