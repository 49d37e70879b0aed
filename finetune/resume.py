"""Resume checks what it resumes: the checkpoint exists, its files are all there and readable,
and it was written by the same run (:func:`finetune.run_folder.continuation_view`).

A checkpoint folder ``checkpoints/step-N`` holds accelerate's state (``model.safetensors``,
``optimizer.bin``, ``scheduler.bin``, ``random_states_*.pkl``, ...) and ``train_state.json``,
which records the step, the loss history, the recipe's continuation view and a manifest of the
other files with their sizes. :func:`checkpoint_problem` checks a folder against its manifest
(and that every safetensors header parses) so that a missing or damaged file is named before the
model loads, instead of surfacing as an unrelated message deep in ``load_state``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from finetune.run_folder import RunFolderError

__all__ = ["CheckpointError", "CHECKPOINT_PREFIX", "STATE_NAME", "file_manifest", "checkpoint_problem",
           "find_checkpoint"]

log = logging.getLogger("xlipkit")

CHECKPOINT_PREFIX = "step-"
STATE_NAME = "train_state.json"
_WEIGHT_PATTERNS = ("model*.safetensors", "pytorch_model*.bin", "model*.bin")


class CheckpointError(RunFolderError, FileNotFoundError):
    """``train.resume`` names no usable checkpoint: missing, incomplete or damaged (names the file)."""


def file_manifest(folder: str | os.PathLike) -> dict[str, int]:
    """``{relative path: size in bytes}`` of every file under ``folder`` (``train_state.json`` aside)."""
    root = Path(folder)
    return {p.relative_to(root).as_posix(): p.stat().st_size
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != STATE_NAME}


def _safetensors_problem(path: Path) -> str | None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            handle.keys()
    except Exception as error:  # safetensors raises its own SafetensorError on a bad header
        return f"{path.name} is corrupt ({type(error).__name__}: {error})"
    return None


def checkpoint_problem(folder: str | os.PathLike) -> str | None:
    """What is wrong with a checkpoint folder, naming the file, or None when it looks complete.

    Checks that ``train_state.json`` exists and parses, that every file of its manifest exists
    with the recorded size (a checkpoint from before manifests needs model weights), and that
    every ``.safetensors`` file's header parses.
    """
    root = Path(folder)
    state_file = root / STATE_NAME
    if not state_file.is_file():
        return f"{STATE_NAME} is missing (the save was interrupted?)"
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        return f"{STATE_NAME} is corrupt ({error})"
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        return f"{STATE_NAME} is corrupt (no step)"
    manifest = state.get("files")
    if isinstance(manifest, dict):
        for name, size in manifest.items():
            path = root / name
            if not path.is_file():
                return f"{name} is missing"
            if path.stat().st_size != size:
                return f"{name} is damaged ({path.stat().st_size} bytes, {size} when saved)"
    elif not any(root.glob(pattern) for pattern in _WEIGHT_PATTERNS):
        return "the model weights (model.safetensors) are missing"
    for path in sorted(root.rglob("*.safetensors")):
        problem = _safetensors_problem(path)
        if problem:
            return problem
    return None


def _steps(ckpt_dir: Path) -> list[Path]:
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.iterdir()
             if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX) and p.name[len(CHECKPOINT_PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]))


def find_checkpoint(resume: str | None, ckpt_dir: str | os.PathLike) -> Path | None:
    """The checkpoint ``train.resume`` names, checked with :func:`checkpoint_problem`.

    Args:
        resume: None (no resume), ``latest`` (the newest usable ``step-N`` in ``ckpt_dir``;
            a newer one that is incomplete is skipped with a warning that says which and why) or a
            checkpoint folder.
        ckpt_dir: the run's ``checkpoints/`` folder.
    Returns:
        the folder, or None (no resume, or ``latest`` with no checkpoint yet: logged).
    Raises:
        CheckpointError: a path that is not a usable checkpoint, or ``latest`` when every
            checkpoint is unusable (naming the file of each).
    """
    if not resume:
        return None
    ckpt_dir = Path(ckpt_dir)
    if resume == "latest":
        candidates = _steps(ckpt_dir)
        if not candidates:
            log.info("train.resume: latest: no checkpoint in %s yet; training starts at step 0", ckpt_dir)
            return None
        problems = []
        for path in reversed(candidates):
            problem = checkpoint_problem(path)
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
    problem = checkpoint_problem(path)
    if problem is not None:
        hint = "" if (path / STATE_NAME).exists() or not _steps(path) else "; its step-N folders are checkpoints"
        raise CheckpointError(f"train.resume: {resume} is not a checkpoint folder ({problem}){hint}")
    return path


def check_continuation(saved: dict[str, Any] | None, current: dict[str, Any] | None, checkpoint: Path, *,
                       ignore_changes: bool = False) -> None:
    """Compare the continuation view a checkpoint was saved with to the current recipe's.

    Raises:
        RunFolderError: listing the differing keys, unless ``ignore_changes`` (then logged).
    """
    from finetune.run_folder import differing_keys

    if saved is None or current is None or saved == current:
        return
    changes = differing_keys(saved, current)
    if not ignore_changes:
        raise RunFolderError(
            f"train.resume: {checkpoint} was saved by a run with a different recipe; differing keys: "
            f"{'; '.join(changes)}. Resume with that run's recipe, or set train.resume_ignore_changes: true "
            "to continue with these changes on purpose")
    log.warning("train.resume_ignore_changes: continuing %s with changed keys: %s", checkpoint, "; ".join(changes))
