"""Run folders are never silently overwritten.

Before :func:`finetune.training.run_recipe` writes anything into ``output.dir`` it calls
:func:`check_run_folder`: a folder that holds a finished run (``metrics.json`` or ``final/``) or
the ``recipe.yaml`` of a different run is refused, unless ``output.overwrite: true`` (then
:func:`clear_previous_run` removes the old run's files first, so nothing of it mixes with the new
one) or ``train.resume`` continues the same run (:mod:`finetune.runs.identity`). Whatever ``output.overwrite``
says, a run never replaces what it did not write: a folder holding ``report.md``, ``plots/`` or ``logs/`` but no run
is the user's, and the recipe file being run may not be the folder's own ``recipe.yaml`` unless a run wrote it.

Temporary files carry their writer's :func:`finetune.files.process_tag` (``PID@HOST``), and
:func:`clean_stale_temporaries` removes only those of processes that are gone. ``python -m finetune.evaluate``'s
``--out`` is checked by :func:`check_eval_output`. The lock that keeps a second process out is
:mod:`finetune.runs.lock`; the checks of room on the disk are :mod:`finetune.runs.space`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from finetune.files import owner_alive, tag_owner
from finetune.runs.checkpoints import checkpoint_problem, list_checkpoints
from finetune.runs.errors import RunFolderError
from finetune.runs.identity import (RECIPE_NAME, comparable_recipe, continuation_hash, continuation_view,
                                    differing_keys, read_run_recipe, with_added_defaults)

__all__ = ["RUN_OUTPUTS", "check_eval_output", "check_run_folder", "clean_stale_temporaries", "clear_previous_run"]

#: what a run writes into its folder (removed by ``output.overwrite: true``)
RUN_OUTPUTS = ("final", "metrics.json", "report.md", "plots", "checkpoints", "logs", RECIPE_NAME)


def _check_recipe_file(folder: Path, recipe_file: str | os.PathLike | None) -> None:
    """Refuse a run of the recipe file ``FOLDER/recipe.yaml`` into ``folder`` unless a run wrote that file: the run
    writes its resolved recipe there, which would replace the user's recipe (and ``output.overwrite`` delete it)."""
    if recipe_file is None or not folder.is_dir():
        return
    path = Path(recipe_file)
    if path.resolve() != folder.resolve() / RECIPE_NAME:
        return
    from finetune.config.io import is_dumped_recipe

    try:
        if is_dumped_recipe(path.read_text(encoding="utf-8")):
            return  # the run's own resolved recipe (a resume, a rerun): replacing it loses nothing
    except (OSError, UnicodeDecodeError):
        pass
    raise RunFolderError(
        f"the recipe being run, {str(path)!r}, is the recipe.yaml of output.dir {str(folder)!r}, where a run writes "
        "its resolved recipe: the run would replace your recipe, comments and all (and output.overwrite would delete "
        f"it). Keep the recipe outside the output folder: move it (e.g. `mv {path} {folder.name}.yaml`) and run that "
        f"with the same output.dir, or choose another output.dir")


def check_run_folder(out_dir: str | os.PathLike, recipe: dict[str, Any], *, overwrite: bool = False,
                     resume: str | None = None, ignore_changes: bool = False,
                     recipe_file: str | os.PathLike | None = None) -> str:
    """Decide whether a run may write into ``out_dir``; nothing is written.

    Args:
        out_dir: the recipe's ``output.dir``.
        recipe: the new run's recipe as ``recipe_to_dict`` gives it.
        overwrite: ``output.overwrite``.
        resume: ``train.resume`` (``latest`` or a checkpoint path), or None.
        ignore_changes: ``train.resume_ignore_changes``.
        recipe_file: the recipe file being run (``Recipe.source``), or None.
    Returns:
        ``"new"`` (no run there), ``"overwrite"`` (a run is there and will be replaced),
        ``"resume"`` (the same run continues) or ``"rerun"`` (an unfinished run of the same
        recipe starts again).
    Raises:
        RunFolderError: the folder is a file; it holds a finished run or another recipe's run (the
            message lists the differing keys and the ways out; it suggests ``train.resume: latest``
            only where a usable checkpoint exists); ``train.resume: latest`` into a finished run with
            no usable checkpoint (it would train again from step 0 over the finished run). Whatever
            ``overwrite`` says: ``recipe_file`` is the folder's ``recipe.yaml`` and was not written by a
            run; the folder holds what a run writes (``report.md``, ``plots/``, ``logs/``) but no run.
    """
    folder = Path(out_dir)
    if folder.exists() and not folder.is_dir():
        raise RunFolderError(f"output.dir {str(folder)!r} is a file; set output.dir to a folder")
    _check_recipe_file(folder, recipe_file)
    previous = read_run_recipe(folder) if folder.is_dir() else None
    if previous is not None:  # keys added to xlipkit since that run, at their defaults now, are no change
        previous = with_added_defaults(previous, recipe)
    finished = [n for n in ("metrics.json", "final") if (folder / n).exists()]
    has_checkpoints = (folder / "checkpoints").is_dir() and any((folder / "checkpoints").iterdir())
    if previous is None and not finished and not has_checkpoints:
        _check_no_foreign_outputs(folder)
        return "new"
    if overwrite:
        return "overwrite"
    ways_out = ("choose another output.dir, or set output.overwrite: true to replace it")
    resumable = _resumable_checkpoints(folder)
    if resume:
        if finished and resume == "latest" and not resumable:
            # nothing to continue from: `latest` would train from step 0 and replace the finished run
            raise RunFolderError(
                f"train.resume: latest: output.dir {str(folder)!r} holds a finished run ({', '.join(finished)}) "
                f"and no usable checkpoint to continue it from (train.checkpoint_every was 0, or the checkpoints "
                f"are gone), so resuming would train it again from step 0 over the finished run; {ways_out}")
        if previous is not None and continuation_hash(previous) != continuation_hash(recipe):
            changes = differing_keys(continuation_view(previous), continuation_view(recipe))
            if not ignore_changes:
                raise RunFolderError(
                    f"train.resume: {resume} would continue the run in {str(folder)!r} with a different recipe; "
                    f"differing keys: {'; '.join(changes)}. Resume with the run's own recipe ({folder / RECIPE_NAME}), "
                    f"set train.resume_ignore_changes: true to continue with these changes on purpose, or {ways_out}")
        return "resume"
    if finished:
        # suggest a resume only where it continues from a checkpoint (without one it would start again)
        resume_hint = f" (or train.resume: latest to continue it from {resumable[-1]})" if resumable else ""
        raise RunFolderError(
            f"output.dir {str(folder)!r} holds a finished run ({', '.join(finished)}); {ways_out}{resume_hint}")
    if previous is not None and comparable_recipe(previous) != comparable_recipe(recipe):
        changes = differing_keys(comparable_recipe(previous), comparable_recipe(recipe))
        raise RunFolderError(
            f"output.dir {str(folder)!r} holds another run (its recipe.yaml differs: {'; '.join(changes[:10])}"
            f"{' ...' if len(changes) > 10 else ''}); {ways_out}")
    return "rerun"


def _check_no_foreign_outputs(folder: Path) -> None:
    """Refuse a folder that holds no run but names a run writes (``report.md``, ``plots/``, ``logs/``): they are
    the user's own, and a run (or a failed one cleaning up, or ``output.overwrite``) would replace them."""
    if not folder.is_dir():
        return
    ckpt = folder / "checkpoints"
    found = [name + ("/" if (folder / name).is_dir() else "") for name in RUN_OUTPUTS
             if ((folder / name).exists() or (folder / name).is_symlink())
             and not (folder / name == ckpt and ckpt.is_dir() and not any(ckpt.iterdir()))]
    if found:
        raise RunFolderError(
            f"output.dir {str(folder)!r} holds {', '.join(found)} but no run (no {RECIPE_NAME}, metrics.json, final/ "
            "or checkpoints/): they look like your own files, which a run would replace (output.overwrite replaces "
            "only a run's files); choose another output.dir, or move them out of that folder")


def _resumable_checkpoints(folder: Path) -> list[str]:
    """The ``checkpoints/step-N`` folders of ``folder`` that ``train.resume: latest`` could continue from
    (complete, :func:`finetune.runs.checkpoints.checkpoint_problem` without reading every byte: the resume itself
    checks the sha256 of each file), oldest first, as ``checkpoints/step-N``."""
    return [f"checkpoints/{p.name}" for p in list_checkpoints(folder / "checkpoints")
            if checkpoint_problem(p, hashes=False) is None]


def clear_previous_run(out_dir: str | os.PathLike) -> list[str]:
    """Remove what a run wrote into ``out_dir`` (:data:`RUN_OUTPUTS`); other files stay.

    Returns:
        the names removed.
    """
    folder = Path(out_dir)
    removed = []
    for name in RUN_OUTPUTS:
        path = folder / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
            removed.append(name)
        elif path.exists() or path.is_symlink():
            path.unlink()
            removed.append(name)
    return removed


def clean_stale_temporaries(out_dir: str | os.PathLike) -> list[str]:
    """Remove the temporary folders and files a killed run left behind: ``.final.tmp-*`` /
    ``.final.old-*`` (an interrupted model save), ``.NAME.*.tmp`` (an interrupted atomic file
    write) and ``checkpoints/step-N.tmp`` (an interrupted checkpoint).

    A name that carries its writer's :func:`finetune.files.process_tag` is removed only when that process is
    gone (:func:`finetune.files.owner_alive`); an untagged one (written by an older version, or by code that does
    not tag its names) only because the caller holds the folder's :class:`finetune.runs.lock.RunLock`, so no
    other run writes there.

    Returns:
        the paths removed, relative to ``out_dir``.
    """
    folder = Path(out_dir)
    if not folder.is_dir():
        return []
    stale = [p for p in folder.iterdir() if p.name.startswith(".") and (".tmp-" in p.name or ".old-" in p.name
                                                                          or p.name.endswith(".tmp"))]
    checkpoints = folder / "checkpoints"
    if checkpoints.is_dir():
        stale += [p for p in checkpoints.iterdir() if p.name.endswith(".tmp")]
    removed = []
    for path in stale:
        owner = tag_owner(path.name)
        if owner is not None and owner_alive(*owner):
            continue  # a live process (another rank, an evaluation) is writing it
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return sorted(str(p.relative_to(folder)) for p in removed)


def check_eval_output(out: str | os.PathLike, model_dirs: list[str | os.PathLike]) -> Path:
    """Check the ``--out`` of ``python -m finetune.evaluate`` before anything runs.

    Refused: a folder; a path inside a model folder being evaluated (``final/config.json`` would
    destroy the model); an existing file that is not an earlier evaluation result (JSON with
    ``"sets"``).

    Returns:
        the path.
    Raises:
        RunFolderError: naming the path and what to give instead.
    """
    path = Path(out)
    if path.is_dir():
        raise RunFolderError(f"--out {str(path)!r} is a folder; give a file path such as {path / 'metrics_eval.json'}")
    resolved = path.resolve()
    for folder in model_dirs:
        folder = Path(folder)
        if folder.is_dir() and resolved.is_relative_to(folder.resolve()):
            raise RunFolderError(f"--out {str(path)!r} is inside the model folder {str(folder)!r}, whose files it "
                                 "could overwrite; write the results elsewhere (e.g. the run folder's "
                                 "metrics_eval.json)")
    if path.exists():
        try:
            previous = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            previous = None
        if not (isinstance(previous, dict) and "sets" in previous):
            raise RunFolderError(f"--out {str(path)!r} exists and is not an earlier evaluation result; "
                                 "give a new file path (or remove that file)")
    return path
